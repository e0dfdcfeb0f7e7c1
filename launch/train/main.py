"""The trainer's entry point: ``torchrun --nproc-per-node N -m hla_sp.launch.train <flags>``.

A megatron-core GPT with HLA core attention; :class:`~hla_sp.launch.train.trainer.Trainer`
(model, optimizer, data, the step and the loop) is in :mod:`hla_sp.launch.train.trainer`.
:func:`run` validates the flags, joins the process group, trains and shuts down; it is
also what the Ray sweep runs inside each worker.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

# Megatron warns on import about apex/TE; on CPU that is the expected state.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=".*apex.*", category=UserWarning)
warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
# at TP > 1, once per rank: advice for CUDA's overlap of Megatron's async all-reduce,
# which on CPU means nothing and on GPUs is not this trainer's schedule; it broke the
# one-line stop of a failing run into five lines
warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hla_sp.launch import checkpoint  # noqa: E402
from hla_sp.launch.checkpoint.preflight_checks import nothing_to_do  # noqa: E402
from hla_sp.launch.checks import validate  # noqa: E402
from hla_sp.launch.config.train_config import TrainConfig, parse_args, world_size_from_env  # noqa: E402
from hla_sp.launch.distributed import faults, signals  # noqa: E402
from hla_sp.launch.distributed.process_groups import (  # noqa: E402
    Topology,
    init_distributed,
    shutdown,
)
from hla_sp.launch.extras import MissingExtra, require  # noqa: E402
from hla_sp.launch.model.estimate import advice as memory_advice  # noqa: E402
from hla_sp.launch.train import metrics  # noqa: E402
from hla_sp.launch.train.trainer import NonFiniteError, Trainer  # noqa: E402

__all__ = ["Trainer", "main", "run"]


def _banner(cfg: TrainConfig, topo: Topology, trainer: Trainer) -> str:
    n, m = sum(p.numel() for p in trainer.model.parameters()), cfg.model
    return (
        f"hla-sp train: {m.attention} GPT, {m.num_layers} layers x {m.hidden_size} hidden, "
        f"{m.num_attention_heads} heads, {n:,} parameters (per TP rank); seq {m.seq_length:,}, "
        f"global batch {trainer.global_batch}; world {topo.world_size} = TP {topo.tp} x "
        f"CP {topo.cp} x DP {topo.dp} on {dist.get_backend()} ({topo.device.type}); "
        f"data {cfg.data.data}{' ' + ','.join(cfg.data.data_path) if cfg.data.data_path else ''}"
        + (f"; {'bf16' if cfg.precision.bf16 else 'fp16'} with fp32 master weights"
           if cfg.precision.bf16 or cfg.precision.fp16 else "")
        + (f"; resumed at iteration {trainer.iteration}" if trainer.resumed_from is not None
           else "")
    )


def _announce_start(cfg: TrainConfig) -> bool:
    """Megatron's --load semantics, said once (by global rank 0) before any process group:
    no checkpoint in --load starts fresh, a finished run has nothing to do, and a
    --save directory with checkpoints that this run does not resume is overwritten.
    Returns False when there is nothing to train."""
    first = int(os.environ.get("RANK", dist.get_rank() if dist.is_initialized() else 0)) == 0
    resume = checkpoint.resume_iteration(cfg.checkpoint.load, cfg.checkpoint.ckpt_step)
    if cfg.checkpoint.load is not None and resume is None:
        if first:
            metrics.say(f"--load {cfg.checkpoint.load}: no checkpoint there, starting from "
                        f"iteration 0")
    elif (resume is not None and resume >= cfg.optimizer.train_iters
          and not cfg.evaluation.skip_train):
        if first:  # (hla-sp train says this itself, before starting torchrun)
            metrics.say(nothing_to_do(cfg) or "nothing to do")
        return False
    if cfg.checkpoint.save is not None and resume is None and os.path.isdir(cfg.checkpoint.save):
        try:
            old = checkpoint.latest_iteration(cfg.checkpoint.save)
        except checkpoint.CheckpointError:
            old = None
        if old is not None and first:
            metrics.say(
                f"--save {cfg.checkpoint.save} holds checkpoints up to iteration {old}; this run "
                f"starts at 0 and its checkpoints replace them (pass --load {cfg.checkpoint.save} "
                f"to resume)"
            )
    return True


def run(
    cfg: TrainConfig,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    exit_on_error: bool = True,
) -> list[dict[str, Any]]:
    """Validate, join the process group, train, shut down; return the records.

    Used by ``main`` under torchrun and by the Ray sweep inside each worker (which
    passes ``exit_on_error=False`` so that Ray sees the exception).
    """
    world = dist.get_world_size() if dist.is_initialized() else world_size_from_env()
    validate(cfg, world)  # before any process group is created
    checkpoint.preflight(cfg)  # --save writable, free, not another run's; the schedule
    if not _announce_start(cfg):
        return []  # a finished run: nothing to do (every rank reads the same files)
    topo = init_distributed(
        cfg.parallelism.tensor_model_parallel_size, cfg.parallelism.context_parallel_size,
        cfg.parallelism.distributed_timeout_minutes
    )
    metrics.reset_peak_memory()  # count this run: model, optimizer, activations
    heartbeat = faults.Heartbeat(topo.rank)
    faults.install_sigterm_handler()
    signals.install(graceful=cfg.checkpoint.exit_signal_handler)  # SIGTERM too, with the flag
    trainer: Trainer | None = None
    try:
        # --save: one run at a time; rank 0 locks it before anything is written there,
        # and a refusal stops every rank (released on each exit below)
        checkpoint.hold(cfg.checkpoint.save, topo.rank, cfg.checkpoint.break_save_lock)
        trainer = Trainer(cfg, topo)
        if topo.is_first:
            metrics.say(_banner(cfg, topo, trainer))
        if cfg.evaluation.skip_train:
            records = [trainer.evaluate_checkpoint()]
            if topo.is_first:
                metrics.say(_evaluation_line(cfg, records[0]))
        else:
            records = trainer.train(on_record, heartbeat)
            if topo.is_first:
                _say_trained(cfg, trainer, records)
    except signals.Interrupted as stop:
        # every rank got the signal (torchrun passes it on): one line for the run
        heartbeat.stop()
        checkpoint.release_save_locks()
        if topo.is_first:
            print(_interrupted_line(stop, trainer), file=sys.stderr, flush=True)
        if not exit_on_error:
            raise
        sys.stdout.flush()
        os._exit(128 + stop.signum)
    except NonFiniteError as err:
        # every rank saw the same global loss and norm: one line for the run, non-zero
        checkpoint.release_save_locks()
        heartbeat.stop()
        faults.report_known(err)
        if not exit_on_error:
            raise
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    except Exception as err:
        checkpoint.release_save_locks()
        known = faults.known_error(err)
        if known is not None:
            # a checkpoint, data or flag error says it all: one line for the run (every
            # rank may raise it), no traceback, no guess about the peers
            faults.report_known(known)
            heartbeat.stop()
            if not exit_on_error:
                raise
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(faults.KNOWN_EXIT)
        heartbeat.stop()
        oom = _is_oom(err)
        advice = None
        if oom:
            advice = f"out of memory; {memory_advice(cfg, topo.world_size)}"
        # a stop from outside or an OOM needs no traceback
        faults.report_failure(topo.rank, topo.world_size, err, with_traceback=not oom
                              and not isinstance(err, faults.StoppedByLauncher), advice=advice)
        if not exit_on_error:
            raise
        # a broken group can hang in destroy or atexit; leave now, non-zero
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    heartbeat.stop()
    checkpoint.release_save_locks()
    shutdown(topo)
    return records


def _interrupted_line(stop: signals.Interrupted, trainer: Trainer | None) -> str:
    """The one line of a run a signal stopped: during an iteration, or during the save of
    one (the iteration counter has moved on by then: the save is of the one just done)."""
    saving = getattr(stop, "hla_sp_saving", None)
    if saving is not None:
        return (f"hla-sp train: stopped by {stop} while saving iteration {saving}'s "
                f"checkpoint, which is left incomplete (the previous one stays the latest); "
                f"--exit-signal-handler finishes the iteration and saves")
    it = trainer.iteration if trainer is not None else 0
    return (f"hla-sp train: stopped by {stop} during iteration {it + 1}; nothing saved "
            f"since then (--exit-signal-handler finishes the iteration and saves)")


def _is_oom(err: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator's "can't allocate memory"."""
    return isinstance(err, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(err, RuntimeError) and ("out of memory" in str(err)
                                           or "can't allocate memory" in str(err)))


def _say_trained(cfg: TrainConfig, trainer: Trainer, records: list[dict[str, Any]]) -> None:
    """Rank 0's closing lines of a training run: the loss, the log and its plot, and how
    to resume a run a signal stopped, or what to run next."""
    if records:
        metrics.say(
            f"done: loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f} over "
            f"{len(records)} iterations; peak memory per rank "
            f"{[metrics.gib(m) for m in records[-1]['peak_mem_bytes_per_rank']]}"
        )
    if cfg.logging.log_jsonl:
        metrics.say(f"metrics: {os.path.abspath(cfg.logging.log_jsonl)} (one JSON line per "
                    f"iteration)")
        metrics.say(metrics.plot_run(cfg.logging.log_jsonl))
    if trainer.stopped_by:
        metrics.say(_stopped_line(cfg, trainer))
    elif records:
        from hla_sp.launch.train.after_training import next_commands

        for line in next_commands(cfg, trainer.iteration):
            metrics.say(line)


def _evaluation_line(cfg: TrainConfig, rec: dict[str, Any]) -> str:
    """The result of --skip-train, in one line."""
    acc = (f", recall accuracy {rec['val_recall_acc']:.4f}" if "val_recall_acc" in rec
           else "")
    return (f"evaluated the checkpoint at iteration {rec['iteration']} in {cfg.checkpoint.load}: "
            f"held-out loss {rec['val_loss']:.4f}{acc} ({cfg.evaluation.eval_iters} batches of "
            f"{rec['samples_per_batch']})")


def _stopped_line(cfg: TrainConfig, trainer: Trainer) -> str:
    """The one line after a signal under --exit-signal-handler: where, and how to resume."""
    head = (f"stopped by {signals.name(trainer.stopped_by or 0)} after iteration "
            f"{trainer.iteration}/{cfg.optimizer.train_iters}")
    if not cfg.checkpoint.save:
        return f"{head}; nothing saved (no --save), so a rerun starts from iteration 0"
    ck = cfg.checkpoint
    return f"{head}; resume with: {signals.resume_command(ck.save, ck.load)}"


def main(argv: list[str] | None = None) -> int:
    try:
        require("megatron", "hla_sp.launch.train")
    except MissingExtra as e:
        print(f"hla_sp.launch.train: error: {e}", file=sys.stderr)
        return 2
    cfg = parse_args(argv)
    try:
        run(cfg)
    except faults.known_kinds() as e:  # before the process group: the checks, the preflight
        faults.report_known(e, "hla_sp.launch.train")
        return faults.KNOWN_EXIT
    return 0


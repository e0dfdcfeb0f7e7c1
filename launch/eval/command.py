"""``hla-sp eval``: long-context measurements of a checkpoint, sharded like training.

    hla-sp eval --load DIR --task ppl-by-position --lengths 4k,16k,64k [--samples N]
    hla-sp eval --load DIR --task passkey --lengths 4k,64k --depths 0,0.5,1
                [--nproc-per-node P --context-parallel-size P] [--output DIR]

The launcher checks everything it can before any process starts (the flags, the
checkpoint's config, the lengths against the model's positions and the zigzag split,
the data), then runs torchrun with ``-m hla_sp.launch.eval.run`` through the same
command builder as ``hla-sp train`` (:func:`hla_sp.launch.cli.commands.torchrun_command`). The
P ranks hold one sequence between them, Megatron's zigzag chunks r and 2P-1-r each, so
the longest sequence needs 1/P of the memory on each; there are no gradients. Rank 0
writes ``TASK.json`` (every figure, the command, the checkpoint, the timing) and
``TASK.png`` into ``--output``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import warnings
from collections.abc import Callable
from typing import Any

from hla_sp.launch import checkpoint
from hla_sp.launch.checkpoint.layout import CheckpointError
from hla_sp.launch.checks import validate
from hla_sp.launch.config.flags import OneLineParser
from hla_sp.launch.distributed.allocator import set_worker_allocator
from hla_sp.launch.distributed.torchrun import main as torchrun_main
from hla_sp.launch.errors import DEBUG_ENV, ConfigError, DatasetError, debug
from hla_sp.launch.eval import tasks
from hla_sp.launch.eval.tasks import check_lengths
from hla_sp.launch.extras import require
from hla_sp.megatron_patch.args import import_custom

TASKS = ("ppl-by-position", "passkey")
# the launcher's command line, quoted, for the record the workers write
COMMAND_ENV = "HLA_SP_EVAL_COMMAND"
WORKER = "hla_sp.launch.eval.run"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="hla-sp eval", allow_abbrev=False,
        description="Measure a checkpoint of hla-sp train at long context: the loss by "
                    "position bucket on held-out text, or passkey retrieval; the sequence "
                    "is split over --context-parallel-size ranks as in training.")
    p.add_argument("--load", required=True, help="Checkpoint directory (hla-sp train --save).")
    p.add_argument("--ckpt-step", type=int, default=None,
                   help="Evaluate this iteration instead of the latest.")
    p.add_argument("--task", required=True, choices=TASKS,
                   help="ppl-by-position: loss per log-spaced position bucket; passkey: "
                        "retrieval of a 5-digit key hidden in filler text.")
    p.add_argument("--lengths", required=True, metavar="L1,L2,...",
                   help="Sequence lengths in tokens, k = 1024 and M = 1024² (4k,16k,1M); "
                        "each divisible by 2 x --context-parallel-size (refused otherwise).")
    p.add_argument("--samples", type=int, default=4,
                   help="Windows per length (ppl-by-position), sequences per length and "
                        "depth (passkey).")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1",
                   help="passkey: where the key sits, as fractions of the filler.")
    p.add_argument("--seed", type=int, default=0, help="passkey: seed of the keys and filler.")
    p.add_argument("--first-bucket", type=int, default=1024, metavar="TOKENS",
                   help="ppl-by-position: the first bucket is [0, TOKENS); each next one is "
                        "twice as long.")
    p.add_argument("--data-path", nargs="+", default=None, metavar="PREFIX",
                   help="ppl-by-position: indexed datasets (make-dataset), read as one stream "
                        "from their first token; default: the built-in held-out text.")
    p.add_argument("--nproc-per-node", type=int, default=1, help="Processes (ranks).")
    p.add_argument("--context-parallel-size", type=int, default=None,
                   help="Ranks that share each sequence; equal to --nproc-per-node (the "
                        "default).")
    p.add_argument("--output", default="hla-sp-eval", metavar="DIR",
                   help="Where TASK.json and TASK.png go (created).")
    p.add_argument("--custom-import", action="append", default=[], metavar="MODULE",
                   help="Import this module first (one that registers an operator); the "
                        "modules the training run named are imported anyway.")
    p.add_argument("--distributed-timeout-minutes", type=float, default=30.0,
                   help="Timeout of the collectives (a million tokens on CPU take minutes).")
    p.add_argument("--debug", action="store_true",
                   help="Tracebacks instead of one-line errors (as HLA_SP_DEBUG=1).")
    return p


@dataclasses.dataclass
class Plan:
    """What the flags and the checkpoint resolve to; the launcher and every worker make
    the same one."""

    args: argparse.Namespace
    cfg: Any  # the checkpoint's TrainConfig, at this CP size (TP 1, no recompute)
    iteration: int
    lengths: list[int]
    depths: list[float]
    cp: int
    data: Any  # eval_tasks.TextWindows (ppl-by-position), the RunTokenizer (passkey)


def _check_flags(args: argparse.Namespace) -> int:
    """The numeric flags, named; returns the CP size."""
    if args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node: expected >= 1, got {args.nproc_per_node}")
    cp = args.context_parallel_size or args.nproc_per_node
    if cp != args.nproc_per_node:
        raise ConfigError(f"--context-parallel-size: expected --nproc-per-node "
                          f"({args.nproc_per_node}; every rank holds a share of the one "
                          f"sequence, no data or tensor parallelism), got {cp}")
    for flag, value in (("--samples", args.samples), ("--first-bucket", args.first_bucket)):
        if value < 1:
            raise ConfigError(f"{flag}: expected >= 1, got {value}")
    if args.ckpt_step is not None and args.ckpt_step < 0:
        raise ConfigError(f"--ckpt-step: expected >= 0, got {args.ckpt_step}")
    if args.distributed_timeout_minutes <= 0:
        raise ConfigError(f"--distributed-timeout-minutes: expected > 0, got "
                          f"{args.distributed_timeout_minutes}")
    if args.data_path and args.task != "ppl-by-position":
        raise ConfigError(f"--data-path: goes with --task ppl-by-position, got --task "
                          f"{args.task} (passkey writes its own text)")
    return cp


def _check_model(cfg: Any, cp: int, lengths: list[int]) -> Any:
    """The checkpoint's model at this CP size, checked as the trainer checks it (heads,
    attention, a hybrid's layers under CP); returns that config."""
    import torch

    table = None
    if cfg.model.position_embedding_type == "learned_absolute":
        table = cfg.model.max_position_embeddings or cfg.model.seq_length
    check_lengths(lengths, cp, table, cfg.model.position_embedding_type)
    if cfg.model.position_embedding_type == "rope" and not torch.cuda.is_available():
        raise ConfigError("checkpoint: position_embedding_type 'rope': megatron-core's rotary "
                          "embedding runs on a CUDA device, and this machine has none")
    # the table keeps the checkpoint's size; the sequence is the run's, one per step
    cfg = cfg.replace(context_parallel_size=cp, tensor_model_parallel_size=1,
        recompute_granularity=None, recompute_activations=False, micro_batch_size=1,
        global_batch_size=None, max_position_embeddings=table or cfg.model.max_position_embeddings,
        seq_length=min(lengths), load=None, save=None)
    validate(cfg, cp, offline=True)  # the flags alone: the data is eval's own
    return cfg


def make_plan(args: argparse.Namespace) -> Plan:
    """Check the flags, the checkpoint and the data, in that order; nothing is run."""

    cp = _check_flags(args)
    lengths = tasks.parse_lengths(args.lengths)
    depths = tasks.parse_depths(args.depths)
    try:
        import_custom(args.custom_import)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    cfg, it = checkpoint.load_run_config(args.load, args.ckpt_step)
    run_cfg = _check_model(cfg, cp, lengths)
    data: Any
    if args.task == "passkey":
        data = tasks.run_tokenizer(cfg)
        low = tasks.passkey_minimum(data)
        if min(lengths) < low:
            raise ConfigError(f"--lengths: expected at least {low} tokens for the passkey "
                              f"prompt, got {min(lengths)}")
    else:
        # the windows' text comes from the checkpoint's own --seq-length (see text_windows)
        data = tasks.text_windows(cfg, args.data_path, args.samples, max(lengths))
    return Plan(args, run_cfg, it, lengths, depths, cp, data)


def output_paths(args: argparse.Namespace) -> tuple[str, str]:
    """The JSON and PNG that rank 0 writes."""
    return (os.path.join(args.output, f"{args.task}.json"),
            os.path.join(args.output, f"{args.task}.png"))


def prepare_output(args: argparse.Namespace) -> None:
    """Create --output (the launcher, and the workers when started without it)."""
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise ConfigError(f"--output {args.output}: expected a directory, got a file")
    try:
        os.makedirs(args.output, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--output {args.output}: cannot create it ({e.strerror})") from None
    if not os.access(args.output, os.W_OK):
        raise ConfigError(f"--output {args.output}: not writable")


def _environment(argv: list[str], debug: bool) -> None:
    """What the workers inherit: the command for their record, threads, the allocator."""

    os.environ[COMMAND_ENV] = shlex.join(["hla-sp", "eval", *argv])
    set_worker_allocator()
    # as hla-sp train (and torchrun) have it; more threads per rank pay only for a model
    # wide enough, and lose badly on a busy machine
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if debug:
        os.environ[DEBUG_ENV] = "1"


def main(argv: list[str], torchrun_command: Callable[..., list[str]]) -> int:
    """The ``hla-sp eval`` command: check, then run the workers under torchrun (built by
    ``torchrun_command``, the one ``hla-sp train`` uses); returns the exit status."""

    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", message=".*(Apex|apex|Transformer Engine).*")
    try:
        require("megatron", "hla-sp eval")
        require("plot", "hla-sp eval")  # the PNG is half of the result
        plan = make_plan(args)
        from hla_sp.launch.eval.memory import check_eval_memory

        check_eval_memory(plan.cfg, plan.lengths, plan.cp)  # the launcher's, before any rank
        prepare_output(args)
    except (ConfigError, CheckpointError, DatasetError) as e:
        if args.debug or debug():
            raise
        print(f"hla-sp eval: error: {e}", file=sys.stderr)
        return 2
    # the workers evaluate the iteration checked here, even if a newer one lands meanwhile
    worker_argv = list(argv) + ([] if args.ckpt_step is not None
                                else ["--ckpt-step", str(plan.iteration)])
    launch = argparse.Namespace(nproc_per_node=plan.cp, nnodes="1", rdzv_endpoint="",
                                node_rank=None, max_restarts=0)
    cmd = torchrun_command(launch, worker_argv, module=WORKER)
    assert cmd[1:3] == ["-m", "hla_sp.launch.torchrun"], cmd
    _environment(argv, args.debug)
    sys.stdout.flush()

    return torchrun_main(cmd[3:], prog="hla-sp eval")

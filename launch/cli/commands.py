"""``hla-sp``: the console script.

    hla-sp train [--nproc-per-node N] [--nnodes N --rdzv-endpoint HOST:PORT ...] TRAINER FLAGS
    hla-sp sweep CONFIG [--output-dir DIR]
    hla-sp make-dataset --input FILES --output-prefix PREFIX
    hla-sp generate --load DIR --prompt TEXT [--max-new-tokens N --temperature T ...]
    hla-sp export --load DIR --output HF_DIR [--dtype fp32|bf16 --force]
    hla-sp eval --load DIR --task ppl-by-position|passkey --lengths 4k,64k,1M [--nproc-per-node P]

``train`` checks the trainer flags against the world it is about to start
(nproc-per-node x nnodes), the data and the checkpoints in --save and --load (the
preflight), says "nothing to do" for a finished run, then replaces itself with torchrun
(:mod:`hla_sp.launch.torchrun`, which prints a worker's known error once, in one line)
running ``-m hla_sp.launch.train``. Everything it does not know goes to the trainer.
Tracebacks: ``--debug`` or ``HLA_SP_DEBUG=1``.
``generate`` samples from a checkpoint in this process (:mod:`hla_sp.launch.export.generate`).
``export`` writes a checkpoint as a Hugging Face model directory
(:mod:`hla_sp.launch.export.command`).
``eval`` measures a checkpoint at long context, the sequence split over the ranks as in
training, under the same torchrun (:mod:`hla_sp.launch.eval.command`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import warnings

from hla_sp.launch.checkpoint.layout import CheckpointError
from hla_sp.launch.checkpoint.preflight_checks import nothing_to_do, preflight
from hla_sp.launch.checks import validate
from hla_sp.launch.config.train_config import ConfigError, TrainConfig, build_parser, parse_args
from hla_sp.launch.data.datasets import BYTE_VOCAB, DatasetError
from hla_sp.launch.data.make_dataset import main as make_main
from hla_sp.launch.distributed.allocator import set_worker_allocator
from hla_sp.launch.distributed.signals import COMMAND_ENV
from hla_sp.launch.errors import DEBUG_ENV, debug
from hla_sp.launch.eval.command import main as eval_main
from hla_sp.launch.export.command import main as export_main
from hla_sp.launch.export.generate import main as generate_main
from hla_sp.launch.extras import require
from hla_sp.launch.model.estimate import planned_device_memory, summary
from hla_sp.launch.sweep.ray_sweep import main as sweep_main


def torchrun_command(launch: argparse.Namespace, trainer_argv: list[str],
                     module: str = "hla_sp.launch.train") -> list[str]:
    """The torchrun command line ``hla-sp train`` runs (torch.distributed.run through
    :mod:`hla_sp.launch.torchrun`, which exits in one line on a signal); ``hla-sp eval``
    runs its own worker ``module``."""
    cmd = [
        sys.executable,
        "-m",
        "hla_sp.launch.torchrun",
        "--nproc-per-node",
        str(launch.nproc_per_node),
    ]
    if launch.nnodes == "1" and not launch.rdzv_endpoint:
        cmd.append("--standalone")  # a private rendezvous on a free port
    else:
        if not launch.rdzv_endpoint:
            raise ConfigError(
                "--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)"
            )
        cmd += [
            "--nnodes", launch.nnodes,
            "--rdzv-backend", launch.rdzv_backend,
            "--rdzv-endpoint", launch.rdzv_endpoint,
            "--rdzv-id", launch.rdzv_id,
        ]  # fmt: skip
        if launch.node_rank is not None:
            cmd += ["--node-rank", str(launch.node_rank)]
    cmd += ["--max-restarts", str(launch.max_restarts), "-m", module, *trainer_argv]
    return cmd


def _check_launch(launch: argparse.Namespace) -> int:
    """The launcher's own flags, named; returns the (maximum) number of nodes."""
    if launch.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node: expected >= 1, got {launch.nproc_per_node}")
    parts = launch.nnodes.split(":")
    if len(parts) > 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ConfigError(f"--nnodes: expected N or MIN:MAX with N >= 1, got {launch.nnodes!r}")
    if len(parts) == 2 and int(parts[0]) > int(parts[1]):
        raise ConfigError(f"--nnodes: expected MIN <= MAX, got {launch.nnodes!r}")
    nnodes = int(parts[-1])
    if launch.node_rank is not None and not 0 <= launch.node_rank < nnodes:
        raise ConfigError(f"--node-rank: expected 0 <= rank < {nnodes}, got {launch.node_rank}")
    if launch.max_restarts < 0:
        raise ConfigError(f"--max-restarts: expected >= 0, got {launch.max_restarts}")
    return nnodes


def _launcher_flags(ap: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The flags ``hla-sp train`` keeps for torchrun; the rest go to the trainer. Each
    also takes torchrun's underscore spelling (--nproc_per_node)."""

    def add(flag: str, **kw: object) -> None:
        under = "--" + flag[2:].replace("-", "_")
        ap.add_argument(flag, *([under] if under != flag else []), **kw)  # type: ignore[arg-type]

    add("--nproc-per-node", type=int, default=1, help="Processes on this node.")
    add("--nnodes", default="1", help="Nodes (or MIN:MAX), as torchrun takes it.")
    add("--node-rank", type=int, default=None, help="This node's rank (optional).")
    add("--rdzv-endpoint", default="", help="HOST:PORT of the rendezvous (multi-node).")
    add("--rdzv-backend", default="c10d", help="torchrun rendezvous backend.")
    add("--rdzv-id", default="hla-sp", help="Job id shared by all nodes.")
    add("--max-restarts", type=int, default=0, help="torchrun worker-group restarts.")
    add("--device-memory", type=float, default=None, metavar="GIB",
        help="With --dry-run: the memory of one accelerator to plan for, in GiB (default: "
             "the visible GPU's, else 80).")
    add("--standalone", action="store_true",
        help="Accepted for torchrun's sake: one node without --rdzv-endpoint is standalone.")
    add("--debug", action="store_true",
        help="Print tracebacks: an error of a known kind (a flag, a checkpoint, a data file) "
             "is otherwise one line, printed once, and torchrun's failure summary is left "
             "out (the same as HLA_SP_DEBUG=1).")
    add("--dry-run", action="store_true",
        help="Check the flags, print the parameter count, the memory per rank (from the "
             "memory model of docs/launch.md) and the model TFLOP per step, then the "
             "torchrun command; start nothing.")


def train_help() -> str:
    """``hla-sp train --help``: the launcher's flags, then every trainer flag."""
    p = build_parser(prog="hla-sp train")
    p.description = (
        "Check the flags against the world about to start, then run torchrun with "
        "hla_sp.launch.train on this node. The launcher flags go to torchrun; every other "
        "flag goes to the trainer."
    )
    _launcher_flags(p.add_argument_group("launcher (torchrun)"))
    return p.format_help()


def planned_vocab(cfg: TrainConfig) -> int:
    """The vocabulary ``--dry-run`` plans with, from the flags alone: ``--vocab-size``, or
    the byte-level vocabulary of the built-in data; with ``--data-path`` and no
    ``--vocab-size``, a :class:`ConfigError` (the planner opens no data file)."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    if cfg.data.data_path:
        raise ConfigError(
            f"--dry-run: expected --vocab-size with --data-path (the plan reads no data file, "
            f"so it cannot see the tokenizer's vocabulary: pass it, e.g. --vocab-size 50257 "
            f"for GPT-2's), got --data-path {' '.join(cfg.data.data_path)} alone")

    return BYTE_VOCAB


def _train(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(train_help())
        return 0
    ap = argparse.ArgumentParser(prog="hla-sp train", allow_abbrev=False, add_help=False)
    _launcher_flags(ap)
    launch, rest = ap.parse_known_args(argv)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if launch.debug:  # the workers inherit it (and torchrun's wrapper reads it)
        os.environ[DEBUG_ENV] = "1"
    # the data checks import megatron-core, which warns about apex/TE: expected on CPU
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    try:
        require("megatron", "hla-sp train")  # one line here, not a traceback per rank
        nnodes = _check_launch(launch)
        cfg = parse_args(rest, raise_errors=True, prog="hla-sp train")
        given_vocab = cfg.model.vocab_size  # validate fills it from --tokenizer
        # --dry-run plans from the flags alone (a login node has no /data, no GPU)
        validate(cfg, launch.nproc_per_node * nnodes, offline=launch.dry_run)
        done = None
        if not launch.dry_run:
            # the checkpoint checks here too, before torchrun starts: one line, not one per
            # rank followed by torchrun's failure summary
            preflight(cfg)
            done = nothing_to_do(cfg)
        cmd = torchrun_command(launch, rest)
        if launch.dry_run:
            vocab, device = planned_vocab(cfg), planned_device_memory(launch.device_memory)
    except (ConfigError, CheckpointError, DatasetError) as e:
        if debug():
            raise
        print(f"hla-sp train: error: {e}", file=sys.stderr)
        return 2
    if done is not None and not launch.dry_run:
        print(done, flush=True)  # a finished run: start nothing
        return 0
    if launch.dry_run:
        source = ("--vocab-size" if given_vocab else f"--tokenizer {cfg.model.tokenizer}"
                  if cfg.model.tokenizer else "the byte-level default")
        print(f"plan: vocabulary {vocab:,} ({source}), {device[1]} per rank")
        for line in summary(cfg, launch.nproc_per_node * nnodes, vocab=vocab, device=device):
            print(line)
        print(" ".join(cmd))
        return 0
    sys.stdout.flush()
    set_worker_allocator()  # glibc's thresholds for the workers, unless the user chose
    # torchrun sets 1 for its workers anyway when unset, with a four-line warning saying so
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the resume line after a signal quotes the user's own command
    os.environ[COMMAND_ENV] = shlex.join(["hla-sp", "train", *argv])
    if cfg.checkpoint.exit_signal_handler:  # torchrun's wait for its workers before SIGKILL (30 s)
        os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600")
    os.execv(cmd[0], cmd)
    return 0  # not reached


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = ("usage: hla-sp {train,sweep,make-dataset,generate,export,eval} ... "
             "(hla-sp COMMAND --help for each)")
    if not argv or argv[0] in ("-h", "--help"):
        from hla_sp.launch.config.flags import plain

        print(usage + "\n\n" + plain(__doc__ or ""))
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        return _train(rest)
    if cmd == "sweep":
        return sweep_main(rest)
    if cmd == "make-dataset":
        try:
            require("megatron", "hla-sp make-dataset")  # its writer is Megatron's
        except ConfigError as e:
            print(f"hla-sp make-dataset: error: {e}", file=sys.stderr)
            return 2

        return make_main(rest)
    if cmd == "generate":
        return generate_main(rest)
    if cmd == "export":
        return export_main(rest)
    if cmd == "eval":
        return eval_main(rest, torchrun_command)  # the workers start as train's do
    print(f"hla-sp: unknown command {cmd!r}\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""SIGINT and SIGTERM in the trainer: a clean stop, one line, and the resume command.

With ``--exit-signal-handler`` (Megatron's spelling) the first SIGINT or SIGTERM only
sets a flag; after each iteration the ranks agree on it (one all-reduce), save, draw
the plot and stop, and rank 0 prints the command that resumes. Later signals are
ignored: SLURM and torchrun may both deliver one, and the stop is already under way.

Without the flag a SIGINT stops the run at once: :class:`Interrupted` is raised, rank 0
prints one line and every rank leaves without a traceback. SIGTERM stays with
:mod:`hla_sp.launch.faults`, because torchrun also sends it to the survivors when a
worker dies, and then the diagnosis of that worker is what matters.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist

# the user's own command, set by ``hla-sp train`` for its workers (the resume line)
COMMAND_ENV = "HLA_SP_COMMAND"

_requested: int | None = None


class Interrupted(KeyboardInterrupt):
    """A signal stopped the run at once (no --exit-signal-handler)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _graceful(signum: int, frame: Any) -> None:
    global _requested
    if _requested is None:
        _requested = signum


def _abrupt(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


def install(graceful: bool) -> None:
    """Handle SIGINT (and SIGTERM when ``graceful``); a no-op off the main thread (the
    Ray sweep runs the trainer in a worker thread, where Ray owns the signals)."""
    global _requested
    _requested = None
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, _graceful if graceful else _abrupt)
    if graceful:
        signal.signal(signal.SIGTERM, _graceful)


def requested() -> int | None:
    """The signal this process received, if any (graceful mode)."""
    return _requested


def agreed(device: torch.device) -> int:
    """The signal any rank received (0 if none): every rank stops after the same
    iteration, even when the signal reached only some of them."""
    flag = torch.tensor([_requested or 0], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def resume_command(save: str | None, load: str | None) -> str:
    """The command that continues this run from ``save``: the user's own command line
    (``hla-sp train`` passes it on), with ``--load SAVE`` added unless it is there."""
    cmd = os.environ.get(COMMAND_ENV)
    if not cmd:
        nproc = os.environ.get("LOCAL_WORLD_SIZE", "1")
        cmd = shlex.join(["torchrun", "--nproc-per-node", nproc, "-m", "hla_sp.launch.train",
                          *sys.argv[1:]])
    if save and os.path.abspath(load or "") != os.path.abspath(save):
        cmd += " " + shlex.join(["--load", save])
    return cmd

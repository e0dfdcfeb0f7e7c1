"""SIGINT and SIGTERM in the trainer: a clean stop, one line, and the resume command.

With ``--exit-signal-handler`` (Megatron's spelling) the first SIGINT or SIGTERM only
sets a flag; after each iteration the ranks agree on it (one all-reduce), save, draw
the plot and stop, and rank 0 prints the command that resumes. Later signals are
ignored: SLURM and torchrun may both deliver one, and the stop is already under way.

Without the flag a SIGINT stops the run at once: :class:`Interrupted` is raised, rank 0
prints one line and every rank leaves without a traceback. SIGTERM stays with
:mod:`hla_sp.launch.distributed.faults`, because torchrun also sends it to the survivors when a
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
from hla_sp.launch.config.flags import is_number

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


def own_command() -> list[str]:
    """This run's command line as the user typed it: ``hla-sp train`` passes it on in
    :data:`COMMAND_ENV`; under a plain torchrun it is rebuilt from the trainer's argv."""
    cmd = os.environ.get(COMMAND_ENV)
    if cmd:
        return shlex.split(cmd)
    nproc = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return ["torchrun", "--nproc-per-node", nproc, "-m", "hla_sp.launch.train", *sys.argv[1:]]


def edit_command(argv: list[str], drop: tuple[str, ...] = (),
                 set_values: dict[str, list[str]] | None = None) -> list[str]:
    """``argv`` without the flags in ``drop`` and their values (``--flag V`` or
    ``--flag=V``), then with each flag of ``set_values`` given those values (in place of
    any earlier ones), so that the printed command does exactly what it says."""
    set_values = set_values or {}
    gone = set(drop) | set(set_values)
    out: list[str] = []
    skipping = False
    for tok in argv:
        name = tok.split("=", 1)[0]
        if tok.startswith("--") and name in gone:
            skipping = "=" not in tok  # the values follow, up to the next flag
            continue
        if skipping and not (tok.startswith("-") and len(tok) > 1 and not is_number(tok)):
            continue
        skipping = False
        out.append(tok)
    for flag, values in set_values.items():
        out += [flag, *values]
    return out


def resume_command(save: str | None, load: str | None) -> str:
    """The command that continues this run from ``save``: the user's own command line,
    with ``--load SAVE`` (unless it loads from there already) and without ``--ckpt-step``,
    which would restart from that older checkpoint instead of the newest."""
    argv = own_command()
    changes = {}
    if save and os.path.abspath(load or "") != os.path.abspath(save):
        changes["--load"] = [save]
    return shlex.join(edit_command(argv, drop=("--ckpt-step",), set_values=changes))

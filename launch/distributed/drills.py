"""Fault injection for tests and drills.

``HLA_SP_FAULT=RANK:ITER:KIND`` makes rank RANK, at the start of iteration ITER, ``kill``
itself (SIGKILL), ``hang`` (sleep forever), or ``raise`` an error; ``KIND@save`` does it
while saving iteration ITER's checkpoint instead (after every rank has entered the save).
``hla-sp eval`` reads ITER as the i-th length it evaluates.
"""

from __future__ import annotations

import os
import signal
import time


def maybe_inject(rank: int, iteration: int, phase: str = "step") -> None:
    """Apply ``HLA_SP_FAULT`` if it names this rank, iteration and phase ("step": the
    start of the iteration; "save": inside its checkpoint's save, with ``KIND@save``)."""
    spec = os.environ.get("HLA_SP_FAULT")
    if not spec:
        return
    r, it, kind = spec.split(":")
    kind, _, where = kind.partition("@")
    if int(r) != rank or int(it) != iteration or (where or "step") != phase:
        return
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "hang":
        while True:
            time.sleep(3600)
    elif kind == "raise":
        raise RuntimeError(f"HLA_SP_FAULT: injected error on rank {rank} at iteration {iteration}")
    else:
        raise ValueError(f"HLA_SP_FAULT kind must be kill, hang or raise, got {kind!r}")

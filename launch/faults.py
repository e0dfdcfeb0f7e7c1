"""Failure handling: a dead or hung rank ends every rank, with a message naming it.

Each rank runs a heartbeat thread that writes ``(beat, iteration)`` to the rendezvous
store every second. When a collective fails (gloo/NCCL raise once a peer's socket
closes, or after the process-group timeout when a peer hangs), the surviving rank reads
the heartbeats twice and names the ranks whose beat stopped (dead) or whose iteration
lags (stuck), then exits non-zero. Under torchrun the store lives in the elastic agent,
so it outlives any worker.

Fault injection for tests and drills: ``HLA_SP_FAULT=RANK:ITER:KIND`` makes rank RANK,
at the start of iteration ITER, ``kill`` itself (SIGKILL), ``hang`` (sleep forever), or
``raise`` an error.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

_PREFIX = "hla_sp/heartbeat/"
BEAT_S = 1.0


def _store() -> Any | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no default group, or a backend without a store
        return None


class Heartbeat:
    """Background beats into the store; ``iteration`` is updated by the training loop."""

    def __init__(self, rank: int):
        self.rank = rank
        self.iteration = 0
        self._beat = 0
        self._stop = threading.Event()
        self._store = _store()
        self._thread = threading.Thread(target=self._run, name="hla-sp-heartbeat", daemon=True)
        if self._store is not None:
            self._write()
            self._thread.start()

    def _write(self) -> None:
        self._beat += 1
        self._store.set(f"{_PREFIX}{self.rank}", f"{self._beat}:{self.iteration}")

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._write()
            except Exception:  # the store went away: the run is ending anyway
                return

    def stop(self) -> None:
        self._stop.set()


def _read(store: Any, world_size: int) -> dict[int, tuple[int, int] | None]:
    out: dict[int, tuple[int, int] | None] = {}
    for r in range(world_size):
        key = f"{_PREFIX}{r}"
        try:
            if not store.check([key]):
                out[r] = None
                continue
            beat, it = store.get(key).decode().split(":")
            out[r] = (int(beat), int(it))
        except Exception:
            out[r] = None
    return out


def diagnose(rank: int, world_size: int) -> str:
    """Which peers died or hang, from two heartbeat readings ``3 * BEAT_S`` apart."""
    store = _store()
    if store is None:
        return "no rendezvous store to ask which rank failed; check every rank's log"
    with contextlib.suppress(Exception):
        store.set_timeout(timedelta(seconds=5))
    first = _read(store, world_size)
    time.sleep(3 * BEAT_S)
    second = _read(store, world_size)
    if all(v is None for v in second.values()):
        return "the rendezvous store is unreachable (its host may have died); check every rank"
    dead = [
        r for r in range(world_size) if r != rank and (second[r] is None or second[r] == first[r])
    ]
    alive = {r: v for r, v in second.items() if v is not None and r not in dead}
    top = max((v[1] for v in alive.values()), default=0)
    stuck = [r for r, v in alive.items() if r != rank and v[1] < top]
    parts = []
    if dead:
        last = {r: (first[r][1] if first[r] else "?") for r in dead}
        parts.append(
            "rank(s) "
            + ", ".join(f"{r} (last at iteration {last[r]})" for r in dead)
            + " stopped responding: the process died or was killed"
        )
    if stuck:
        parts.append(
            "rank(s) "
            + ", ".join(f"{r} (at iteration {alive[r][1]}, others at {top})" for r in stuck)
            + " are alive but stuck (hung in user code or a collective)"
        )
    return "; ".join(parts) or "every rank still beats; the error is in the collective itself"


def report_failure(rank: int, world_size: int, err: BaseException) -> str:
    """The message a surviving rank prints before exiting non-zero."""
    return (
        f"[hla-sp] rank {rank}/{world_size}: training stopped by {type(err).__name__}: "
        f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}\n"
        f"[hla-sp] rank {rank}: diagnosis: {diagnose(rank, world_size)}"
    )


def maybe_inject(rank: int, iteration: int) -> None:
    """Apply ``HLA_SP_FAULT`` if it names this rank and iteration."""
    spec = os.environ.get("HLA_SP_FAULT")
    if not spec:
        return
    r, it, kind = spec.split(":")
    if int(r) != rank or int(it) != iteration:
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

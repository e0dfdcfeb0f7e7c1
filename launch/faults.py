"""Failure handling: a dead or hung rank ends every rank, with a message naming it.

Each rank runs a heartbeat thread that writes a beat counter, its last finished
iteration and where its main thread is to the rendezvous store twice a second. When a
collective fails (gloo/NCCL raise once a peer's socket closes, or after the
process-group timeout when a peer hangs), the surviving rank reads the heartbeats twice
and names the ranks whose beat stopped (dead), or that lag or sit outside the collective
the others wait in (stuck), then exits non-zero. Under torchrun the store lives in the
elastic agent, so it outlives any worker.

Fault injection for tests and drills: ``HLA_SP_FAULT=RANK:ITER:KIND`` makes rank RANK,
at the start of iteration ITER, ``kill`` itself (SIGKILL), ``hang`` (sleep forever), or
``raise`` an error.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import torch.distributed as dist

_PREFIX = "hla_sp/heartbeat/"
BEAT_S = 0.5
_diagnosing = False


def _on_sigterm(signum: int, frame: Any) -> None:
    # torchrun's agent sends SIGTERM to the survivors as soon as one worker dies. While a
    # survivor is working out which peer failed, finish that (the agent waits up to 30 s
    # before SIGKILL) so the diagnosis reaches the log; otherwise stop at once.
    if not _diagnosing:
        raise SystemExit(128 + signum)


def install_sigterm_handler() -> None:
    """Let a SIGTERM arriving during failure diagnosis wait for the diagnosis to print."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)


def _store() -> Any | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no default group, or a backend without a store
        return None


def _main_thread_location() -> tuple[str, bool]:
    """(innermost frame of the main thread as file:line func, whether it is inside
    torch.distributed, i.e. waiting in a collective)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "?", False
    where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"
    in_collective = False
    f = frame
    while f is not None:
        if f"torch{os.sep}distributed{os.sep}" in f.f_code.co_filename:
            in_collective = True
            break
        f = f.f_back
    return where, in_collective


class Heartbeat:
    """Background beats into the store: a counter, the last finished iteration, and
    where the main thread is (so that a hung rank can be told from its waiting peers)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.iteration = 0
        self._beat = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._store = _store()
        self._thread = threading.Thread(target=self._run, name="hla-sp-heartbeat", daemon=True)
        if self._store is not None:
            self._write()
            self._thread.start()

    def _write(self) -> None:
        where, in_collective = _main_thread_location()
        with self._lock:
            self._beat += 1
            beat = {"beat": self._beat, "it": self.iteration, "at": where, "coll": in_collective}
            self._store.set(f"{_PREFIX}{self.rank}", json.dumps(beat))

    def progress(self, iteration: int) -> None:
        """Record a finished iteration now (a lagging rank is named by its iteration)."""
        self.iteration = iteration
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._write()

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._write()
            except Exception:  # the store went away: the run is ending anyway
                return

    def stop(self) -> None:
        self._stop.set()


def _read(store: Any, world_size: int) -> dict[int, dict[str, Any] | None]:
    out: dict[int, dict[str, Any] | None] = {}
    for r in range(world_size):
        key = f"{_PREFIX}{r}"
        try:
            out[r] = json.loads(store.get(key)) if store.check([key]) else None
        except Exception:
            out[r] = None
    return out


def diagnose(rank: int, world_size: int, self_in_collective: bool = True) -> str:
    """Which peers died or hang, from two heartbeat readings ``3 * BEAT_S`` apart.

    dead: no new beat. stuck: beating, but behind the others' iteration, or outside any
    collective while the others wait in one (the usual shape of a hang in user code).
    """
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
    peers = [r for r in range(world_size) if r != rank]
    dead = [
        r
        for r in peers
        if second[r] is None or first[r] is None or second[r]["beat"] == first[r]["beat"]
    ]
    alive = {r: second[r] for r in peers if r not in dead}
    top = max((v["it"] for v in alive.values()), default=0)
    waiting = self_in_collective or any(v["coll"] for v in alive.values())
    stuck = [r for r, v in alive.items() if v["it"] < top or (waiting and not v["coll"])]
    parts = []
    if dead:
        last = {r: (first[r]["it"] if first[r] else "?") for r in dead}
        parts.append(
            "rank(s) "
            + ", ".join(f"{r} (last finished iteration {last[r]})" for r in dead)
            + " stopped responding: the process died or was killed"
        )
    if stuck:
        parts.append(
            "rank(s) "
            + ", ".join(
                f"{r} (finished iteration {alive[r]['it']}, now at {alive[r]['at']})" for r in stuck
            )
            + " are alive but stuck outside the collective the others wait in"
        )
    return "; ".join(parts) or (
        "every rank still beats and none lags; the error is in the collective itself "
        "(network, or ranks calling different collectives)"
    )


def report_failure(rank: int, world_size: int, err: BaseException) -> str:
    """Print at once that this rank stopped, then which peers failed; return the latter."""
    global _diagnosing
    _diagnosing = True
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    print(
        f"[hla-sp] rank {rank}/{world_size}: training stopped by {type(err).__name__}: {first}",
        file=sys.stderr,
        flush=True,
    )
    tb = traceback.extract_tb(err.__traceback__)
    in_collective = any(f"torch{os.sep}distributed{os.sep}" in fr.filename for fr in tb)
    msg = f"[hla-sp] rank {rank}: diagnosis: {diagnose(rank, world_size, in_collective)}"
    print(msg, file=sys.stderr, flush=True)
    return msg


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

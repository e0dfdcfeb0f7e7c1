"""Failure handling: a dead or hung rank ends every rank, with a message naming it.

Each rank runs a heartbeat thread that writes a beat counter, its last finished
iteration and where its main thread is to the rendezvous store twice a second. When a
collective fails (gloo/NCCL raise once a peer's socket closes, or after the
process-group timeout when a peer hangs), the surviving rank reads the heartbeats twice
and names the ranks whose beat stopped (dead), or that lag or sit outside the collective
the others wait in (stuck), then exits non-zero. Under torchrun the store lives in the
elastic agent, so it outlives any worker.

Fault injection for tests and drills (``HLA_SP_FAULT``):
:mod:`hla_sp.launch.distributed.drills`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from hla_sp.launch import errors
from hla_sp.launch.errors import KNOWN_EXIT, known_kinds  # noqa: F401  (the trainer's faults.X)

_PREFIX = "hla_sp/heartbeat/"
_FAILED = "hla_sp/failed/"  # a rank that stops on its own error says why, for its peers
BEAT_S = 0.5
_diagnosing = False
# (last finished iteration, monotonic time it finished): a failure says how long into
# the next iteration it came, which is the real elapsed time, whatever timeout a
# message mentions.
_progress: tuple[int, float] = (0, time.monotonic())
# the iteration whose checkpoint this rank is writing, None outside a save: a failure
# there is reported as "while saving iteration N", not as time into the next step
_saving: int | None = None
_heartbeat: Heartbeat | None = None  # this process's, once training runs


@contextlib.contextmanager
def saving(iteration: int) -> Iterator[None]:
    """Mark this rank as saving ``iteration`` (for failure messages and the heartbeat).
    An error leaving the save carries the iteration with it: the run's failure report
    comes after the save has been left, and must still say where the error came from."""
    global _saving
    _saving = iteration
    if _heartbeat is not None:  # say it now: a rank killed in the save beats no more
        _heartbeat.beat_now()
    try:
        yield
    except BaseException as e:
        with contextlib.suppress(Exception):
            e.hla_sp_saving = iteration  # type: ignore[attr-defined]
        raise
    finally:
        _saving = None


class StoppedByLauncher(RuntimeError):
    """SIGTERM from the launcher while training: under torchrun, a peer has exited."""


def _on_sigterm(signum: int, frame: Any) -> None:
    # torchrun's agent sends SIGTERM to the survivors as soon as one worker dies. While a
    # survivor is working out which peer failed, finish that (the agent waits up to 30 s
    # before SIGKILL) so the diagnosis reaches the log. The SIGTERM can also come first,
    # before this rank's own collective has failed (a race with the peer's socket
    # closing): then it is raised as an error of the peers' kind, which the training
    # loop reports with the same diagnosis before leaving.
    if _diagnosing:
        return
    if dist.is_available() and dist.is_initialized():
        raise StoppedByLauncher(
            f"signal {signum} from the launcher (torchrun stops every rank once one worker "
            "has exited)")
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
        global _progress, _heartbeat
        _heartbeat = self
        self.rank = rank
        self.iteration = 0
        _progress = (0, time.monotonic())
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
            beat = {"beat": self._beat, "it": self.iteration, "at": where, "coll": in_collective,
                    "saving": _saving}
            self._store.set(f"{_PREFIX}{self.rank}", json.dumps(beat))

    def progress(self, iteration: int) -> None:
        """Record a finished iteration now (a lagging rank is named by its iteration)."""
        global _progress
        self.iteration = iteration
        _progress = (iteration, time.monotonic())
        self.beat_now()

    def beat_now(self) -> None:
        """Write a beat now, not at the next tick (best effort)."""
        if self._store is not None and not self._stop.is_set():
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


def _read(
    store: Any, world_size: int, prefix: str = _PREFIX
) -> dict[int, dict[str, Any] | None]:
    out: dict[int, dict[str, Any] | None] = {}
    for r in range(world_size):
        key = f"{prefix}{r}"
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
    reported = {r: v for r, v in _read(store, world_size, _FAILED).items() if v and r != rank}
    # a peer that saw a broken collective too is a fellow survivor, not the cause; one
    # that stopped on its own error is the cause; neither died
    failed = {r: v for r, v in reported.items() if not v.get("coll")}
    dead = [
        r
        for r in peers
        if r not in reported
        and (second[r] is None or first[r] is None or second[r]["beat"] == first[r]["beat"])
    ]
    alive = {r: second[r] for r in peers if r not in dead and r not in failed and second[r]}
    top = max((v["it"] for v in alive.values()), default=0)
    waiting = self_in_collective or any(v["coll"] for v in alive.values())
    stuck = [r for r, v in alive.items() if v["it"] < top or (waiting and not v["coll"])]
    parts = [
        f"rank {r} stopped on its own error at iteration {v['it'] + 1}: {v['error']}"
        for r, v in sorted(failed.items())
    ]
    if dead:
        last = {r: (first[r]["it"] if first[r] else "?") for r in dead}
        during = {r: (f", while saving iteration {first[r]['saving']}"
                      if first[r] and first[r].get("saving") is not None else "")
                  for r in dead}  # fmt: skip
        parts.append(
            "rank(s) "
            + ", ".join(f"{r} (last finished iteration {last[r]}{during[r]})" for r in dead)
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
        "no peer died, failed or lags (every rank still beats), so the collective itself "
        "failed (network, or ranks calling different collectives)"
    )


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and the exceptions it was raised from, outermost first."""
    out: list[BaseException] = []
    e: BaseException | None = err
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _describe(e: BaseException) -> str:
    """One line for an exception; a disk-full error names ENOSPC and its file."""
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        where = f" writing {e.filename}" if e.filename else ""
        return f"OSError: ENOSPC (no space left on device){where}"
    return f"{type(e).__name__}: {_first_line(e)}"


def _is_collective_error(chain: list[BaseException]) -> bool:
    """Did the error come out of a collective (a peer's fault is then possible)?"""
    for e in chain:
        if isinstance(e, (dist.DistError, StoppedByLauncher)):
            return True
        tb = traceback.extract_tb(e.__traceback__)
        if any(f"torch{os.sep}distributed{os.sep}" in fr.filename for fr in tb):
            return True
    return False


# --- errors of a known kind: one line, once (the rest is in hla_sp.launch.errors) ------


def known_error(err: BaseException) -> BaseException | None:
    """The outermost exception of a known kind in ``err``'s chain, or None: a checkpoint
    read that fails inside DCP's collective is reported as the CheckpointError it was
    raised as, not as the collective's exception."""
    kinds = known_kinds()
    return next((e for e in _chain(err) if isinstance(e, kinds)), None)


def global_rank() -> int:
    """This process's global rank (torchrun's RANK; 0 outside torchrun)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def report_known(err: BaseException, prefix: str = "hla-sp train") -> None:
    """Report an error of a known kind in one line, once for the run.

    Under ``hla-sp train`` the line goes to the launcher's report directory and the
    launcher prints it (once however many ranks raised it, without torchrun's summary);
    under a plain torchrun global rank 0 prints it. With a process group, the error is
    also published for the peers, whose failure report then names it. Every rank prints
    its traceback under ``HLA_SP_DEBUG``.
    """
    rank = global_rank()
    line = _first_line(err) or type(err).__name__
    store = _store()
    if store is not None:  # the peers name it instead of calling this rank dead
        with contextlib.suppress(Exception):
            store.set_timeout(timedelta(seconds=5))
            store.set(f"{_FAILED}{rank}",
                      json.dumps({"it": _progress[0], "error": f"{type(err).__name__}: {line}"}))
    if errors.debug():
        traceback.print_exception(err, file=sys.stderr)
    where = os.environ.get(errors.REPORT_ENV)
    if where and os.path.isdir(where) and errors.write_report(where, rank, type(err).__name__,
                                                              line):
        return
    if rank == 0 or errors.debug():
        print(f"{prefix}: error: {line}", file=sys.stderr, flush=True)


def report_failure(
    rank: int, world_size: int, err: BaseException, with_traceback: bool = False,
    advice: str | None = None, doing: str = "training",
) -> str:
    """Say why this rank stopped (``err``'s traceback first if ``with_traceback``), the
    root cause first, then ``advice`` if given; return the last line. ``doing`` names the
    work ("training"; "evaluation" has no iterations to place the failure in).

    Only an error that came out of a collective can be a peer's fault: then the
    heartbeats say which peer died, failed or hangs (the "diagnosis" line). An error of
    this rank's own (bad data, a checkpoint, a full disk, NaN) is published to the store
    so that the peers, which see only a broken collective, can name it. Under ``hla-sp
    train`` (:data:`errors.REPORT_ENV`, no ``HLA_SP_DEBUG``) it all goes to the launcher,
    which prints the first failing rank's traceback once and one summary line.
    """
    global _diagnosing
    # first, before the traceback: formatting it reads source files, slow enough on a
    # loaded machine for torchrun's SIGTERM to land inside it and cut the report short
    _diagnosing = True
    reports, to_launcher = os.environ.get(errors.REPORT_ENV, ""), errors.reporting()
    text = "".join(traceback.format_exception(err)) if with_traceback else ""
    chain = _chain(err)
    root = next((e for e in chain if isinstance(e, OSError) and e.errno == errno.ENOSPC),
                chain[-1])
    it, since = _progress
    saving = next((e.hla_sp_saving for e in chain if hasattr(e, "hla_sp_saving")), _saving)
    if saving is not None:  # the step is done; the failure came in the checkpoint's write
        where = f"while saving iteration {saving}"
    else:
        where = (f"{time.monotonic() - since:.1f} s into iteration {it + 1}"
                 if doing == "training" else f"during {doing}")
    lines = [f"[hla-sp] rank {rank}/{world_size}: {doing} stopped by {_describe(root)} "
             f"({where})"] + ([f"[hla-sp] rank {rank}: raised as {_describe(err)}"]
                              if root is not err else [])
    if not to_launcher:  # before the diagnosis, which may be cut short by a SIGTERM
        _say(text, lines)
    collective = _is_collective_error(chain)
    store = _store()
    if store is not None:
        # said before the diagnosis: a peer diagnosing at the same moment then sees this
        # rank as failed (or as waiting on a collective), not as dead
        with contextlib.suppress(Exception):
            store.set_timeout(timedelta(seconds=5))
            store.set(f"{_FAILED}{rank}", json.dumps(
                {"it": it, "error": _describe(root), "coll": collective}))
    if collective:
        msg = f"[hla-sp] rank {rank}: diagnosis: {diagnose(rank, world_size, True)}"
    else:
        msg = (
            f"[hla-sp] rank {rank}: this rank's own error (not a peer's, not the network); "
            f"the other ranks stop when they next wait for it"
        )
    tail = [msg] + ([f"[hla-sp] rank {rank}: {advice}"] if advice else [])
    if to_launcher:
        if errors.write_failure(reports, errors.Failure(
                rank=rank, world_size=world_size, own=not collective, error=_describe(root),
                where=where, lines=lines + tail, traceback=text)):
            return tail[-1]
        _say(text, lines)  # no report directory after all: say it here
    _say("", tail)
    return tail[-1]


def _say(text: str, lines: list[str]) -> None:
    sys.stderr.write(text)
    for line in lines:
        print(line, file=sys.stderr, flush=True)

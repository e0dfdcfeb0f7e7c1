"""One run at a time per ``--save`` directory: ``SAVE/save.lock``.

Global rank 0 takes the lock after the process group exists and before anything is
written (:func:`hold`, collective: a refusal stops every rank, none waits in a
collective for rank 0); the launcher checks it before torchrun starts
(:func:`check_save_lock`, from :func:`hla_sp.launch.checkpoint.preflight`).

The lock file holds the holder's host, pid, the process's start (to tell a reused pid),
the time it was taken and the scheduler's job id (``SLURM_JOB_ID`` etc.). It is created
atomically: written whole under a private name, then hard-linked to ``save.lock``,
which fails if the name exists (``O_CREAT | O_EXCL`` where hard links are not
supported), so a reader never sees half a lock and two runs never both get it. A holder
on this host whose process is gone (killed, crashed) is taken over with a one-line
warning; one on another host cannot be checked from here, so the refusal names
``--break-save-lock``, which never breaks a holder alive on this host (refused naming
its pid). A lock that cannot be read as one (a directory, no permission, a dangling
link, garbage) is refused in one line naming the file and what to do. Each save first
checks that the lock is still this run's (:mod:`.lock_held`): a run whose lock was
removed or taken stops before writing. Release (end of the run, an error, a signal;
and at interpreter exit as a last resort) removes the file only while it is still this
holder's.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import math
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any

from hla_sp.launch.errors import ConfigError

LOCK = "save.lock"
# the schedulers' job ids, first found wins
JOB_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID", "JOB_ID")
BREAK_FLAG = "--break-save-lock"

_held: dict[str, SaveLock] = {}  # token -> lock this process holds
_guard = threading.Lock()


class SaveLockError(ConfigError):
    """``--save`` is held by another run; the message names the holder."""


def _proc_start(pid: int) -> str | None:
    """When process ``pid`` started, in clock ticks since boot (Linux ``/proc``), so a
    pid reused by a new process is not taken for the holder; None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().decode(errors="replace").rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _alive(holder: dict[str, Any]) -> bool:
    """Whether the holder's process (on this host) still runs."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if pid == os.getpid():  # this very process: alive only if it holds the lock now
        return holder.get("token") in _held
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process exists
    if _zombie(pid):
        return False
    started = holder.get("proc_start")
    now = _proc_start(pid)
    return started is None or now is None or started == now


def _job() -> str | None:
    return next((f"{v}={os.environ[v]}" for v in JOB_VARS if os.environ.get(v)), None)


def describe(holder: dict[str, Any] | None) -> str:
    """The holder in words: host, pid, job, since when."""
    if holder is None:
        return "an unreadable lock"
    when = holder.get("started")
    since = (time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when))
             if isinstance(when, (int, float)) else "?")  # fmt: skip
    job = f", {holder['job']}" if holder.get("job") else ""
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}{job}, since {since}"


class MalformedLock(SaveLockError):
    """The lock file cannot be read as a lock (a directory, unreadable, a dangling
    link, garbage); the message names the file and what to do."""


def _malformed(path: str, what: str, remove: str = "delete it") -> MalformedLock:
    return MalformedLock(f"{path}: {what}, not a lock this tool can read; if no run is using "
                         f"this --save, {remove}, then start again")


def _valid(rec: object) -> bool:
    """A record as :meth:`SaveLock.record` writes it: host, pid, a finite start time."""
    if not isinstance(rec, dict):
        return False
    started, pid = rec.get("started"), rec.get("pid")
    return (isinstance(rec.get("host"), str) and isinstance(pid, int)
            and not isinstance(pid, bool) and pid > 0
            and isinstance(started, (int, float)) and math.isfinite(started))


def _read(path: str) -> tuple[bytes, dict[str, Any] | None] | None:
    """The lock file's bytes and its record (None if garbage: readable bytes that are not
    a lock record); None if there is none. A lock that cannot be read at all (a
    directory, no permission, a dangling symbolic link) raises :class:`MalformedLock`."""
    if os.path.islink(path) and not os.path.exists(path):
        raise _malformed(path, f"a symbolic link to {os.readlink(path)}, which does not exist",
                         "delete the link")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise _malformed(path, "a directory", "remove it (rm -r)") from None
    except PermissionError:
        raise _malformed(path, "unreadable (permission denied)",
                         "fix its permissions or delete it") from None
    except OSError as e:
        raise _malformed(path, f"unreadable ({e.strerror or e})") from None
    try:
        rec = json.loads(raw)
    except ValueError:
        return raw, None
    return raw, rec if _valid(rec) else None


def _refusal(save: str, path: str, holder: dict[str, Any] | None,
             break_lock: bool = False) -> str | None:
    """Why a run may not take ``save``'s lock now (None: the holder is gone, or
    ``break_lock`` breaks it). A holder alive on this host is never broken."""
    if holder is not None and holder.get("host") == socket.gethostname():
        if not _alive(holder):
            return None
        if break_lock:
            return (f"--save {save}: {BREAK_FLAG} refused: the lock's holder, pid "
                    f"{holder['pid']} on this host, is still running ({describe(holder)}; "
                    f"{path}); stop it first, or --save another directory")
        return (f"--save {save}: in use by another run ({describe(holder)}; {path}); wait "
                f"for it to end or stop it, or --save another directory")
    if break_lock:
        return None
    if holder is None:
        return (f"{path}: not a lock record (the file is damaged or was not written by "
                f"hla-sp); if no run is using --save {save}, delete it or pass {BREAK_FLAG}, "
                f"else --save another directory")
    return (f"--save {save}: in use by another run (held by {describe(holder)}; {path}), on "
            f"another host, so whether it still runs cannot be told from here; if it does "
            f"not, pass {BREAK_FLAG} (or delete {path}), else --save another directory")


def check_save_lock(save: str | None, break_lock: bool = False) -> None:
    """Before torchrun (the launcher's preflight): refuse ``--save`` held by a live run,
    or by one on another host, in one line naming it (:class:`SaveLockError`)."""
    import torch.distributed as dist

    if save is None:
        return
    # Inside a run's workers the lock may be this run's own: rank 0 can take it while a
    # slower rank (or one on another node) is still here. Those are left to rank 0's
    # hold(), which refuses on every rank alike: a process group exists (Ray's workers,
    # which also run one run after another), or the holder has this torchrun's run id.
    if dist.is_available() and dist.is_initialized():
        return
    path = os.path.join(save, LOCK)
    found = _read(path)
    if found is None:
        return
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and found[1] is not None and found[1].get("run") == run_id:
        return
    why = _refusal(save, path, found[1], break_lock)
    if why:
        raise SaveLockError(why)


class SaveLock:
    """The lock on one ``--save`` directory, held by this process."""

    def __init__(self, save: str):
        self.save = save
        self.path = os.path.join(save, LOCK)
        self.token = uuid.uuid4().hex
        self.held = False

    def record(self) -> dict[str, Any]:
        pid = os.getpid()
        return {"host": socket.gethostname(), "pid": pid, "proc_start": _proc_start(pid),
                "started": time.time(), "job": _job(), "token": self.token,
                "run": os.environ.get("TORCHELASTIC_RUN_ID"),
                "command": " ".join(sys.argv)[:500]}  # fmt: skip

    def _create(self) -> bool:
        """Create the lock file atomically with this holder's record; False if one exists."""
        data = json.dumps(self.record(), indent=1).encode()
        tmp = f"{self.path}.{socket.gethostname()}.{os.getpid()}.{self.token}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, self.path)  # atomic, and the file is whole when it appears
            return True
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV,
                               errno.EMLINK):
                raise
            return self._create_exclusive(data)  # a filesystem without hard links
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)

    def _create_exclusive(self, data: bytes) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _remove_if(self, raw: bytes) -> None:
        """Remove the lock file if it still holds ``raw`` (the stale lock judged): moved
        aside first, so that a lock another run took meanwhile is put back, not lost."""
        aside = f"{self.path}.{socket.gethostname()}.{os.getpid()}.{self.token}.stale"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # someone else removed it
        with open(aside, "rb") as f:
            moved = f.read()
        if moved != raw:  # a fresh lock of another run: restore it (unless a third took it)
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
        os.remove(aside)

    def acquire(self, break_lock: bool = False) -> None:
        """Take the lock, or raise :class:`SaveLockError` naming the holder; a gone
        holder on this host (or any with ``break_lock``) is replaced with a warning."""
        os.makedirs(self.save, exist_ok=True)
        for _ in range(8):  # each round either wins, refuses, or removes a stale lock
            if self._create():
                self.held = True
                with _guard:
                    _held[self.token] = self
                return
            found = _read(self.path)
            if found is None:
                continue  # released meanwhile
            raw, holder = found
            why = _refusal(self.save, self.path, holder, break_lock)
            if why:
                raise SaveLockError(why)
            gone = (holder is not None and holder.get("host") == socket.gethostname()
                    and not _alive(holder))
            how = "whose process is gone" if gone else f"broken by {BREAK_FLAG}"
            print(f"[hla-sp] warning: --save {self.save}: taking over the lock of a run "
                  f"{how} ({describe(holder)})", file=sys.stderr, flush=True)
            self._remove_if(raw)
        raise SaveLockError(f"--save {self.save}: could not take {self.path}: other runs keep "
                            f"taking it; --save another directory")

    def release(self) -> None:
        """Remove the lock file if it is still this holder's; safe to call twice, from
        any exit path."""
        with _guard:
            if not self.held:
                return
            self.held = False
            _held.pop(self.token, None)
        found = _read(self.path)
        if found is not None and found[1] is not None and found[1].get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)

    def __enter__(self) -> SaveLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _NoLock(SaveLock):
    """What ranks other than 0, and runs without --save, hold: nothing to release."""

    def __init__(self) -> None:
        self.held = False


def hold(save: str | None, rank: int, break_lock: bool = False) -> SaveLock:
    """Collective: global rank 0 takes ``save``'s lock; every rank returns a lock to
    release at the end of the run (a no-op one on the others), or every rank raises the
    same :class:`SaveLockError` (one broadcast from rank 0)."""
    import torch.distributed as dist

    lock: SaveLock = _NoLock()
    why: str | None = None
    if save is not None and rank == 0:
        lock = SaveLock(save)
        try:
            lock.acquire(break_lock)
        except SaveLockError as e:
            why = str(e)
        except OSError as e:
            why = f"--save {save}: cannot create the lock {lock.path} ({e.strerror or e})"
    if save is not None and dist.is_initialized() and dist.get_world_size() > 1:
        box = [why]
        dist.broadcast_object_list(box, src=0)
        why = box[0]
    if why is not None:
        raise SaveLockError(why)
    return lock


@atexit.register
def release_all() -> None:
    """Release every lock this process holds: the trainer calls it on each of its exits
    (normal, error, signal; before ``os._exit``, which skips atexit), and it runs at
    interpreter exit as a last resort."""
    for lock in list(_held.values()):
        with contextlib.suppress(Exception):
            lock.release()

"""The checkpoint directory: names, atomic writes, ``latest``, completeness, pruning.

Every file is written under a temporary name and renamed; a checkpoint directory gets
its ``iter_`` name only by the rename at the end of a save, after every rank's files
(see :mod:`hla_sp.launch.checkpoint` for the layout).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import re
import shutil
import sys
from typing import Any

import torch
import torch.distributed as dist
from hla_sp.launch.errors import CheckpointError  # raised here; its one home is errors

LATEST = "latest_checkpointed_iteration.txt"
CONFIG = "config.json"
# rank 0's small file: iteration, data position, scheduler, optimizer hyperparameters
COMMON = "common.pt"
# the torch.distributed.checkpoint directory of the model and optimizer tensors
SHARDED = "model_optim"
# the format before resharding: one torch.save file per tensor-parallel rank
LEGACY_MODEL = "model_optim_tp00.pt"
_ITER = re.compile(r"iter_(\d{7,})")
# an iteration moved aside while its re-save is swapped in, and one being deleted by
# --keep-last: neither is a complete checkpoint under its own name
OLD, DEL = ".old", ".del"


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def write_error(e: OSError, path: str) -> OSError:
    """The same OSError with the file named: a write to an open file (torch.save into
    ``f``) reports ENOSPC or EIO without a path, and a full disk must say which one."""
    if e.filename:
        return e
    code = e.errno if e.errno is not None else errno.EIO
    what = "disk full (ENOSPC)" if code == errno.ENOSPC else os.strerror(code)
    return OSError(code, f"{what} while writing the checkpoint file", path)


def atomic_write_bytes(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise write_error(e, path) from e
    os.replace(tmp, path)


def atomic_torch_save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise write_error(e, path) from e
    except RuntimeError as e:  # torch.save wraps the file's OSError in a RuntimeError
        cause = e.__cause__ or e.__context__
        if isinstance(cause, OSError):
            raise write_error(cause, path) from e
        raise
    os.replace(tmp, path)


def remove_leftovers(root: str) -> None:
    """Delete what interrupted saves left behind: ``iter_*.tmp`` directories, ``latest``
    temporaries and half-deleted ``--keep-last`` victims; put back an old copy that an
    interrupted swap moved aside (its new copy never arrived). Only rank 0 calls it,
    between barriers, so no live save of this run can be writing them."""
    for pattern in ("iter_*.tmp", "iter_*" + DEL):
        for d in glob.glob(os.path.join(glob.escape(root), pattern)):
            shutil.rmtree(d, ignore_errors=True)
    for d in glob.glob(os.path.join(glob.escape(root), "iter_*" + OLD)):
        final = d[: -len(OLD)]
        if os.path.isdir(final):
            shutil.rmtree(d, ignore_errors=True)  # the swap finished: the old copy goes
        else:
            os.replace(d, final)  # the swap stopped half-way: the old copy is the checkpoint
    for f in glob.glob(os.path.join(glob.escape(root), LATEST + ".tmp*")):
        with contextlib.suppress(OSError):
            os.remove(f)


def read_torch_file(path: str, what: str) -> dict[str, Any]:
    """torch.load with errors that name the file (an empty file is a bare EOFError)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing ({what})")
    try:
        out = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"{path}: cannot read the {what} ({os.path.getsize(path)} bytes; "
            f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}); "
            f"the file is truncated or corrupt: resume from another iteration with --ckpt-step"
        ) from e
    if not isinstance(out, dict):
        raise CheckpointError(f"{path}: expected a dict ({what}), got {type(out).__name__}")
    return out


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune(root: str, newest: int, keep_last: int, keep: set[int] | frozenset[int] = frozenset()
          ) -> None:
    """Delete the checkpoints older than ``newest`` beyond the newest ``keep_last``; those
    above it (a run resumed from an earlier --ckpt-step) are not this run's to delete,
    and neither are those in ``keep`` (the newest finite one, the one the run loaded).
    Each is renamed first, so a crash mid-delete never leaves a partial checkpoint under
    a checkpoint's name."""
    older = [it for it in complete_iterations(root) if it < newest]
    for it in older[: max(0, len(older) - (keep_last - 1))]:
        if it in keep:
            continue
        doomed = iter_dir(root, it) + DEL
        os.replace(iter_dir(root, it), doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def is_complete(path: str) -> bool:
    """A checkpoint directory whose files were all written: it only gets its name by
    the rename at the end of a save, after every rank's files; its main files are
    checked as well, against a directory emptied by hand: ``common.pt`` and the DCP
    ``.metadata`` (written last by DCP), or the old format's TP rank 0 file."""
    if not os.path.isdir(path):
        return False
    new = os.path.isfile(os.path.join(path, COMMON)) and os.path.isfile(
        os.path.join(path, SHARDED, ".metadata"))
    return new or os.path.isfile(os.path.join(path, LEGACY_MODEL))


def complete_iterations(root: str) -> list[int]:
    """Iterations with a complete ``iter_`` directory under ``root``, ascending."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    out = []
    for name in names:
        m = _ITER.fullmatch(name)
        if m and is_complete(os.path.join(root, name)):
            out.append(int(m.group(1)))
    return sorted(out)


def _read_latest(root: str) -> int | None:
    """The number in ``latest``, None without the file; garbage raises, naming it."""
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        raw = f.read(64)
    text = raw.decode("ascii", errors="replace").strip()
    if not text.isdigit():
        raise CheckpointError(
            f"{path}: expected the number of the latest complete iteration (written by "
            f"--save), got {raw!r}; pass --ckpt-step N to pick an iter_ directory, or "
            f"delete the file"
        )
    return int(text)


_warned: set[str] = set()


def warn_once(msg: str) -> None:
    """One line on stderr, once per process, from global rank 0 only (every rank reads
    the same directory and would say the same)."""
    rank = os.environ.get("RANK")
    if rank is None and dist.is_available() and dist.is_initialized():
        rank = str(dist.get_rank())
    if msg in _warned or rank not in (None, "0"):
        return
    _warned.add(msg)
    print(f"[hla-sp] warning: {msg}", file=sys.stderr, flush=True)


def latest_iteration(root: str) -> int | None:
    """The iteration to resume from ``root``: the one ``latest`` names when its directory
    is complete, else the newest complete checkpoint (with a one-line warning); None if
    the directory holds no checkpoint. A ``latest`` that names nothing, or is garbage,
    with no complete checkpoint to fall back to raises :class:`CheckpointError`."""
    try:
        named = _read_latest(root)
        problem = None
    except CheckpointError as e:
        named, problem = None, e
    if named is not None and is_complete(checkpoint_dir(root, named)):
        return named
    done = complete_iterations(root)
    if not done:
        if problem is not None:
            raise problem
        if named is not None:
            raise CheckpointError(
                f"{os.path.join(root, LATEST)} names iteration {named}, but "
                f"{iter_dir(root, named)} is missing or incomplete and no other complete "
                f"checkpoint is there; pass --load to another directory, or delete the file")
        return None
    why = (f"{LATEST} is unreadable" if problem is not None
           else f"{LATEST} is missing" if named is None
           else f"{LATEST} names iteration {named}, whose {os.path.basename(iter_dir(root, named))}"
                f" is missing or incomplete")  # fmt: skip
    warn_once(f"{root}: {why}; using iteration {done[-1]}, the newest complete checkpoint")
    return done[-1]


def checkpoint_dir(root: str, iteration: int) -> str:
    """Where iteration ``iteration`` is: its ``iter_`` directory, or the old copy a swap
    moved aside when the swap stopped before the new copy arrived."""
    final = iter_dir(root, iteration)
    if not os.path.isdir(final) and is_complete(final + OLD):
        return final + OLD
    return final


def resume_iteration(load: str | None, step: int | None) -> int | None:
    """The iteration ``--load`` resumes from: ``step`` when given, else the latest
    complete checkpoint; None when there is nothing to resume (no --load, a missing or
    empty directory), which starts the run fresh as Megatron does."""
    if load is None:
        return None
    if step is not None:
        return step
    if not os.path.isdir(load):
        return None
    return latest_iteration(load)

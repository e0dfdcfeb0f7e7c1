"""Checkpoints: atomic, resumable bit for bit, loadable with ``weights_only=True``.

Layout (a shared filesystem is assumed, as Megatron does)::

    SAVE/latest_checkpointed_iteration.txt     written last; names a complete iter_ dir
    SAVE/iter_0000042/model_optim_tp00.pt      model, optimizer, scheduler, data position
    SAVE/iter_0000042/rng_rank00003.pt         one per rank: torch, CUDA, python, numpy RNG

All ranks write into ``iter_0000042.tmp``; after a barrier rank 0 renames the directory
and only then rewrites ``latest``. A crash at any point leaves the previous checkpoint
as the latest, never a half-written one. Model and optimizer state is identical across
data- and context-parallel replicas, so one replica per tensor-parallel rank writes it;
a checkpoint therefore also loads at a different CP or DP size (RNG states are then
reseeded, with a warning).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import random
import shutil
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

LATEST = "latest_checkpointed_iteration.txt"
CONFIG = "config.json"


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be read; the message names the file."""


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _write_error(e: OSError, path: str) -> OSError:
    """The same OSError with the file named: a write to an open file (torch.save into
    ``f``) reports ENOSPC or EIO without a path, and a full disk must say which one."""
    if e.filename:
        return e
    code = e.errno if e.errno is not None else errno.EIO
    what = "disk full (ENOSPC)" if code == errno.ENOSPC else os.strerror(code)
    return OSError(code, f"{what} while writing the checkpoint file", path)


def _atomic_write_bytes(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise _write_error(e, path) from e
    os.replace(tmp, path)


def _atomic_torch_save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise _write_error(e, path) from e
    except RuntimeError as e:  # torch.save wraps the file's OSError in a RuntimeError
        cause = e.__cause__ or e.__context__
        if isinstance(cause, OSError):
            raise _write_error(cause, path) from e
        raise
    os.replace(tmp, path)


def _remove_leftovers(root: str) -> None:
    """Delete what interrupted saves left behind: ``iter_*.tmp`` directories and
    ``latest`` temporaries. Only rank 0 calls it, between barriers, so no live save
    of this run can be writing them."""
    for d in glob.glob(os.path.join(glob.escape(root), "iter_*.tmp")):
        shutil.rmtree(d, ignore_errors=True)
    for f in glob.glob(os.path.join(glob.escape(root), LATEST + ".tmp*")):
        with contextlib.suppress(OSError):
            os.remove(f)


def _torch_load(path: str, what: str) -> dict[str, Any]:
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


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    """Every RNG the run touches, as tensors and plain values (``weights_only``-safe)."""
    py = random.getstate()
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    out: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, gauss],
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(
    root: str,
    iteration: int,
    *,
    rank: int,
    world_size: int,
    tp_rank: int,
    writes_model: bool,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    consumed_samples: int,
    config: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> str:
    """Write a checkpoint collectively (every rank calls it); return its directory.

    ``extra`` (fp32 master weights, the loss scaler) goes into the model file as well.
    The config is also written as ``config.json``, which ``--load`` compares with the
    new run's flags before any process group exists (without reading the weights).
    """
    final = iter_dir(root, iteration)
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        _remove_leftovers(root)  # of crashed saves, at any iteration (this one included)
        os.makedirs(tmp)
    dist.barrier()
    if writes_model:
        _atomic_torch_save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "iteration": iteration,
                "consumed_samples": consumed_samples,
                "world_size": world_size,
                "config": config,
                **(extra or {}),
            },
            os.path.join(tmp, f"model_optim_tp{tp_rank:02d}.pt"),
        )
    if rank == 0:
        _atomic_write_bytes(
            os.path.join(tmp, CONFIG), json.dumps(config, indent=1, sort_keys=True).encode()
        )
    _atomic_torch_save(
        {"rng": rng_state(), "world_size": world_size},
        os.path.join(tmp, f"rng_rank{rank:05d}.pt"),
    )
    dist.barrier()  # every file is complete before the directory becomes visible
    if rank == 0:
        if os.path.isdir(final):  # re-saving an iteration: replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _atomic_write_bytes(os.path.join(root, LATEST), f"{iteration}\n".encode())
        _fsync_dir(root)
    dist.barrier()
    return final


def latest_iteration(root: str) -> int | None:
    """The iteration ``latest`` names, or None if the directory holds no checkpoint."""
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


def saved_config(root: str, iteration: int) -> dict[str, Any] | None:
    """The trainer config a checkpoint was written with: its ``config.json``, else (older
    checkpoints) the ``config`` entry of the model file, memory-mapped; None if absent."""
    d = iter_dir(root, iteration)
    if not os.path.isdir(d):
        raise CheckpointError(f"no complete checkpoint {d} (iteration {iteration})")
    path = os.path.join(d, CONFIG)
    if os.path.isfile(path):
        try:
            with open(path) as f:
                out = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot read the run's config ({e})") from e
        return out if isinstance(out, dict) else None
    model_file = os.path.join(d, "model_optim_tp00.pt")
    if not os.path.isfile(model_file):
        return None
    try:
        state = torch.load(model_file, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None  # the load itself reports a broken file, naming it
    cfg = state.get("config") if isinstance(state, dict) else None
    return cfg if isinstance(cfg, dict) else None


def load(
    root: str,
    *,
    rank: int,
    world_size: int,
    tp_rank: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    step: int | None = None,
) -> dict[str, Any]:
    """Restore the latest (or ``step``'s) checkpoint; return iteration and data position."""
    it = latest_iteration(root) if step is None else step
    if it is None:
        raise FileNotFoundError(
            f"--load {root}: no {LATEST}; it holds no complete checkpoint (was --save used?)"
        )
    d = iter_dir(root, it)
    if not os.path.isdir(d):
        raise FileNotFoundError(f"--load {root}: no complete checkpoint {d}")
    state = _torch_load(
        os.path.join(d, f"model_optim_tp{tp_rank:02d}.pt"), "model and optimizer state"
    )
    missing = [k for k in ("model", "optimizer", "scheduler", "iteration", "consumed_samples",
                           "world_size") if k not in state]
    if missing:
        raise CheckpointError(
            f"{os.path.join(d, f'model_optim_tp{tp_rank:02d}.pt')}: missing entries {missing}"
        )
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rng_path = os.path.join(d, f"rng_rank{rank:05d}.pt")
    if state["world_size"] != world_size:
        warnings.warn(
            f"checkpoint {d} was written by {state['world_size']} ranks, this run has "
            f"{world_size}: model, optimizer, scheduler and data position resume, RNG "
            f"streams are reseeded, so the resume is not bitwise (dropout masks will differ "
            f"from an uninterrupted run)",
            stacklevel=2,
        )
    elif not os.path.isfile(rng_path):
        warnings.warn(
            f"{rng_path} is missing (rank {rank}'s RNG state): model, optimizer, scheduler "
            f"and data position resume, but this rank's RNG streams are reseeded, so the "
            f"resume is no longer bitwise (dropout masks will differ from an uninterrupted "
            f"run)",
            stacklevel=2,
        )
    else:
        rng = _torch_load(rng_path, f"RNG state of rank {rank}")
        if "rng" not in rng:
            raise CheckpointError(f"{rng_path}: no 'rng' entry (keys {sorted(rng)})")
        set_rng_state(rng["rng"])
    known = {"model", "optimizer", "scheduler", "iteration", "consumed_samples", "world_size",
             "config"}
    return {"iteration": state["iteration"], "consumed_samples": state["consumed_samples"],
            "extra": {k: v for k, v in state.items() if k not in known}}

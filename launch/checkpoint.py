"""Checkpoints: atomic, resumable bit for bit, loadable with ``weights_only=True``.

Layout (a shared filesystem is assumed, as Megatron does)::

    SAVE/latest_checkpointed_iteration.txt     written last; names a complete iter_ dir
    SAVE/iter_0000042/model_optim_tp00.pt      model, optimizer, scheduler, data position
    SAVE/iter_0000042/rng_rank00003.pt         one per rank: torch, CUDA, python, numpy RNG

All ranks write into ``iter_0000042.tmp``; after a barrier rank 0 renames the directory
and only then rewrites ``latest``. A crash at any point leaves the previous checkpoint
as the latest, never a half-written one. Re-saving an iteration that exists moves the
old copy aside (``iter_0000042.old``) and renames the new one in: nothing is deleted
before its replacement is in place, and an interrupted swap is undone by the next save
or read by the next resume. When ``latest`` names a missing or incomplete directory, a
resume falls back to the newest complete checkpoint, with a one-line warning.

Model and optimizer state is identical across data- and context-parallel replicas, so
one replica per tensor-parallel rank writes it; a checkpoint therefore also loads at a
different CP or DP size (RNG states are then reseeded, with a warning).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import random
import re
import shutil
import sys
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

LATEST = "latest_checkpointed_iteration.txt"
CONFIG = "config.json"
_ITER = re.compile(r"iter_(\d{7,})")
# an iteration moved aside while its re-save is swapped in, and one being deleted by
# --keep-last: neither is a complete checkpoint under its own name
_OLD, _DEL = ".old", ".del"


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
    """Delete what interrupted saves left behind: ``iter_*.tmp`` directories, ``latest``
    temporaries and half-deleted ``--keep-last`` victims; put back an old copy that an
    interrupted swap moved aside (its new copy never arrived). Only rank 0 calls it,
    between barriers, so no live save of this run can be writing them."""
    for pattern in ("iter_*.tmp", "iter_*" + _DEL):
        for d in glob.glob(os.path.join(glob.escape(root), pattern)):
            shutil.rmtree(d, ignore_errors=True)
    for d in glob.glob(os.path.join(glob.escape(root), "iter_*" + _OLD)):
        final = d[: -len(_OLD)]
        if os.path.isdir(final):
            shutil.rmtree(d, ignore_errors=True)  # the swap finished: the old copy goes
        else:
            os.replace(d, final)  # the swap stopped half-way: the old copy is the checkpoint
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
    keep_last: int | None = None,
) -> str:
    """Write a checkpoint collectively (every rank calls it); return its directory.

    ``extra`` (fp32 master weights, the loss scaler) goes into the model file as well.
    The config is also written as ``config.json``, which ``--load`` compares with the
    new run's flags before any process group exists (without reading the weights).
    With ``keep_last`` N, older checkpoints beyond the newest N are deleted once this
    one is the latest.
    """
    from hla_sp.launch import faults

    with faults.saving(iteration):
        return _save(root, iteration, rank, world_size, tp_rank, writes_model, model,
                     optimizer, scheduler, consumed_samples, config, extra, keep_last)


def _save(
    root: str, iteration: int, rank: int, world_size: int, tp_rank: int, writes_model: bool,
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
    consumed_samples: int, config: dict[str, Any], extra: dict[str, Any] | None,
    keep_last: int | None,
) -> str:
    from hla_sp.launch import faults

    final = iter_dir(root, iteration)
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        _remove_leftovers(root)  # of crashed saves, at any iteration (this one included)
        os.makedirs(tmp)
    dist.barrier()
    faults.maybe_inject(rank, iteration, phase="save")
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
        old = final + _OLD
        if os.path.isdir(final):
            # re-saving an iteration: move the old copy aside, never delete it first, so
            # that a crash between the two renames still leaves a complete copy
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
        _atomic_write_bytes(os.path.join(root, LATEST), f"{iteration}\n".encode())
        _fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
        if keep_last is not None:
            _prune(root, iteration, keep_last)
    dist.barrier()
    return final


def _prune(root: str, newest: int, keep_last: int) -> None:
    """Delete the checkpoints older than ``newest`` beyond the newest ``keep_last``; those
    above it (a run resumed from an earlier --ckpt-step) are not this run's to delete.
    Each is renamed first, so a crash mid-delete never leaves a partial checkpoint under
    a checkpoint's name."""
    older = [it for it in complete_iterations(root) if it < newest]
    for it in older[: max(0, len(older) - (keep_last - 1))]:
        doomed = iter_dir(root, it) + _DEL
        os.replace(iter_dir(root, it), doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def is_complete(path: str) -> bool:
    """A checkpoint directory whose files were all written: it only gets its name by
    the rename at the end of a save, after every rank's files; the model file of TP
    rank 0 is checked as well, against a directory emptied by hand."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "model_optim_tp00.pt"))


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


def _warn_once(msg: str) -> None:
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
    _warn_once(f"{root}: {why}; using iteration {done[-1]}, the newest complete checkpoint")
    return done[-1]


def checkpoint_dir(root: str, iteration: int) -> str:
    """Where iteration ``iteration`` is: its ``iter_`` directory, or the old copy a swap
    moved aside when the swap stopped before the new copy arrived."""
    final = iter_dir(root, iteration)
    if not os.path.isdir(final) and is_complete(final + _OLD):
        return final + _OLD
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


# deeper than this, a config.json is not one the trainer wrote (its deepest value is a
# list inside the hla table: depth 3); checked before json.loads, which would recurse
_MAX_JSON_DEPTH = 32


def _json_depth_error(text: str) -> str | None:
    """The top-level key under which ``text`` nests deeper than :data:`_MAX_JSON_DEPTH`
    (a scan outside strings, without recursion), or None."""
    depth, in_str, esc, key, last_str = 0, False, False, None, ""
    start = 0
    for i, c in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                last_str = text[start:i]
        elif c == '"':
            in_str, start = True, i + 1
        elif c == ":" and depth == 1:
            key = last_str
        elif c in "[{":
            depth += 1
            if depth > _MAX_JSON_DEPTH:
                return f"key {key!r}" if key is not None else "the top level"
        elif c in "]}":
            depth -= 1
    return None


def _type_error(name: str, value: Any, hint: Any) -> str | None:
    """Why ``value`` cannot be the value of config field ``name`` (annotation ``hint``),
    or None if it can."""
    import types
    import typing

    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
    origin = typing.get_origin(hint)
    if origin is list:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        return None if ok else "a list of strings"
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            return "an object"
        for k, v in value.items():
            if isinstance(v, list):
                if not all(isinstance(x, (str, int, float, bool)) or x is None for x in v):
                    return f"an object of plain values (its {k!r} holds {v!r:.40})"
            elif not (isinstance(v, (str, int, float, bool)) or v is None):
                return f"an object of plain values (its {k!r} holds {v!r:.40})"
        return None
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else "a number"
    if hint is str:
        return None if isinstance(value, str) else "a string"
    return None


def check_config_dict(cfg: Any, where: str) -> dict[str, Any]:
    """A saved trainer config, every known key of the right type; keys this version does
    not know (a newer trainer's) are kept. Raises :class:`CheckpointError` naming the
    key, its value and what was expected."""
    import dataclasses
    import typing

    from hla_sp.launch.config import TrainConfig

    if not isinstance(cfg, dict):
        raise CheckpointError(f"{where}: expected a JSON object of flags, got {type(cfg).__name__}")
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name in cfg:
            want = _type_error(f.name, cfg[f.name], hints[f.name])
            if want:
                raise CheckpointError(
                    f"{where}: key {f.name!r}: expected {want}, got {cfg[f.name]!r:.60}; the "
                    f"file is corrupt or was not written by this trainer")
    return cfg


def saved_config(root: str, iteration: int) -> dict[str, Any] | None:
    """The trainer config a checkpoint was written with: its ``config.json``, else (older
    checkpoints) the ``config`` entry of the model file, memory-mapped; None if absent.
    A malformed one raises :class:`CheckpointError` in one line naming the key."""
    d = checkpoint_dir(root, iteration)
    if not os.path.isdir(d):
        raise CheckpointError(f"no complete checkpoint {d} (iteration {iteration})")
    path = os.path.join(d, CONFIG)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot read the run's config ({e})") from None
        deep = _json_depth_error(text)
        if deep:
            raise CheckpointError(
                f"{path}: {deep} nests more than {_MAX_JSON_DEPTH} levels deep; the file is "
                f"corrupt or was not written by this trainer")
        try:
            out = json.loads(text)
        except ValueError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from None
        return check_config_dict(out, path)
    model_file = os.path.join(d, "model_optim_tp00.pt")
    if not os.path.isfile(model_file):
        return None
    try:
        state = torch.load(model_file, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None  # the load itself reports a broken file, naming it
    cfg = state.get("config") if isinstance(state, dict) else None
    return check_config_dict(cfg, f"{model_file} (its config entry)") if cfg is not None else None


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
    d = checkpoint_dir(root, it)
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


# --- before training: the --save directory and the resume's schedule ----------------


def _dir_bytes(path: str) -> int:
    """Bytes of the files directly in a checkpoint directory."""
    total = 0
    with os.scandir(path) as it:
        for e in it:
            if e.is_file(follow_symlinks=False):
                total += e.stat(follow_symlinks=False).st_size
    return total


def estimate_checkpoint_bytes(cfg: Any) -> int:
    """About how many bytes one checkpoint of ``cfg``'s model takes: the weights (in the
    run's precision), fp32 master copies under --bf16/--fp16 and AdamW's two fp32
    moments, from the parameter count of a megatron-core GPT with tied embeddings."""
    from hla_sp.launch.data import BYTE_VOCAB
    from hla_sp.launch.model import padded_vocab_size

    h, heads = cfg.hidden_size, cfg.num_attention_heads
    kv = h * (cfg.num_query_groups or heads) // heads
    ffn = cfg.ffn_hidden_size or 4 * h
    vocab = padded_vocab_size(cfg.vocab_size or BYTE_VOCAB, cfg.make_vocab_size_divisible_by,
                              cfg.tensor_model_parallel_size)
    positions = 0
    if cfg.position_embedding_type == "learned_absolute":
        positions = cfg.max_position_embeddings or cfg.seq_length
    layer = (h * (h + 2 * kv) + h + 2 * kv) + (h * h + h) + (2 * h * ffn + ffn + h) + 4 * h
    params = (vocab + positions) * h + cfg.num_layers * layer + 2 * h
    half = cfg.bf16 or cfg.fp16
    return params * ((2 + 4) if half else 4) + params * 8


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_save_dir(cfg: Any) -> None:
    """``--save`` checked before any process group, so that a run cannot lose its
    training at the first save: a directory (or creatable), writable, no symlinked
    ``iter_*`` entry, no other run's checkpoints unless ``--load`` names the directory,
    ``--keep-last`` >= 1, and free space for one checkpoint at the current size (the
    newest one in --load or --save, else an estimate from the model). Raises
    ``ConfigError`` with the number."""
    from hla_sp.launch.checks import ConfigError

    save, keep = cfg.save, getattr(cfg, "keep_last", None)
    if keep is not None and (isinstance(keep, bool) or keep < 1):
        raise ConfigError(f"--keep-last: expected an integer >= 1, got {keep!r}")
    if save is None:
        if keep is not None:
            raise ConfigError(f"--keep-last {keep}: goes with --save DIR, got no --save")
        return
    if os.path.exists(save) and not os.path.isdir(save):
        raise ConfigError(f"--save {save}: expected a directory, got a file")
    probe_dir = _nearest_existing(save)
    probe = os.path.join(probe_dir, f".hla_sp_write_probe.{os.getpid()}")
    try:
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ConfigError(
            f"--save {save}: expected a writable directory, but {probe_dir} is not writable "
            f"({e.strerror or e}); --save elsewhere") from None
    if os.path.isdir(save):
        for name in sorted(os.listdir(save)):
            if name.startswith("iter_") and os.path.islink(os.path.join(save, name)):
                raise ConfigError(
                    f"--save {save}: {name} is a symbolic link (to "
                    f"{os.readlink(os.path.join(save, name))}); a save renames directories "
                    f"into place and would replace it: move the link away, or --save elsewhere")
        theirs = complete_iterations(save)
        mine = cfg.load is not None and os.path.isdir(cfg.load) and os.path.samefile(
            cfg.load, save)
        if (theirs or os.path.isfile(os.path.join(save, LATEST))) and not mine:
            held = (f"iterations {theirs[0]}..{theirs[-1]}" if len(theirs) > 1
                    else f"iteration {theirs[0]}" if theirs else f"a {LATEST}")
            raise ConfigError(
                f"--save {save}: holds another run's checkpoints ({held}); pass --load "
                f"{save} to resume that run, or --save a new directory")
    # the size of one checkpoint now: the newest on disk, else the model's estimate
    sized = None
    for root in (cfg.load, save):
        done = complete_iterations(root) if root and os.path.isdir(root) else []
        if done:
            sized = (_dir_bytes(iter_dir(root, done[-1])), iter_dir(root, done[-1]))
            break
    need, what = sized if sized else (estimate_checkpoint_bytes(cfg), "estimated from the model")
    free = shutil.disk_usage(probe_dir).free
    if free < need:
        raise ConfigError(
            f"--save {save}: {_gib(free)} free on its filesystem, one checkpoint needs about "
            f"{_gib(need)} ({need:,} bytes, {what}); free space, or --save elsewhere")


# the schedule flags Megatron's OptimizerParamScheduler checks on load, as trainer flags
_SCHEDULE = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_style", "weight_decay")


def schedule_diff(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``--flag SAVED (checkpoint) != NOW (this run)`` for each learning-rate schedule
    value that differs, the decay length included (--lr-decay-iters, which defaults to
    --train-iters); values the checkpoint does not record are not compared."""
    out = []
    for k in _SCHEDULE:
        if k in saved and k in now and saved[k] != now[k]:
            out.append(f"--{k.replace('_', '-')} {saved[k]} (checkpoint) != {now[k]} (this run)")
    if "train_iters" in saved:
        a = saved.get("lr_decay_iters") or saved["train_iters"]
        b = now.get("lr_decay_iters") or now["train_iters"]
        if a != b:
            flag = ("--lr-decay-iters" if saved.get("lr_decay_iters") or now.get("lr_decay_iters")
                    else "--train-iters")
            out.append(f"{flag} {a} (checkpoint) != {b} (this run), the decay length")
    return out


def check_resume_schedule(cfg: Any) -> None:
    """Megatron's rule on resume: a changed learning-rate schedule is refused with the
    diff, unless --override-opt_param-scheduler (this run's flags win) or
    --use-checkpoint-opt_param-scheduler (the checkpoint's schedule wins) says which."""
    from hla_sp.launch.checks import ConfigError

    override = getattr(cfg, "override_opt_param_scheduler", False)
    use_ckpt = getattr(cfg, "use_checkpoint_opt_param_scheduler", False)
    if override and use_ckpt:
        raise ConfigError(
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude "
            "each other: pass the one that says whose schedule to trust")
    try:
        it = resume_iteration(cfg.load, cfg.ckpt_step)
        saved = saved_config(cfg.load, it) if it is not None else None
    except CheckpointError as e:
        raise ConfigError(f"--load {cfg.load}: {e}") from None
    if saved is None or override or use_ckpt:
        return
    diff = schedule_diff(saved, cfg.to_dict())
    if diff:
        raise ConfigError(
            f"--load {cfg.load}: the checkpoint at iteration {it} has another learning-rate "
            f"schedule: " + "; ".join(diff) + ". Pass --use-checkpoint-opt_param-scheduler to "
            "keep the checkpoint's, or --override-opt_param-scheduler to apply this run's "
            "(Megatron's flags)")


def preflight(cfg: Any) -> None:
    """Everything about --save and --load that can fail later, checked before training
    (no process group, nothing written): :func:`check_save_dir` and
    :func:`check_resume_schedule`."""
    check_save_dir(cfg)
    check_resume_schedule(cfg)

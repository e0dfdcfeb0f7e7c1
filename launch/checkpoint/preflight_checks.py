"""Before training, without a process group: the ``--save`` directory and the resume's
learning-rate schedule (Megatron's rule), each refused in one line with the numbers."""

from __future__ import annotations

import glob
import os
import shutil
from typing import Any

from hla_sp.launch.checkpoint import legacy
from hla_sp.launch.checkpoint.layout import (
    COMMON,
    LATEST,
    LEGACY_MODEL,
    CheckpointError,
    checkpoint_dir,
    complete_iterations,
    iter_dir,
    resume_iteration,
)
from hla_sp.launch.checkpoint.lock import check_save_lock
from hla_sp.launch.checkpoint.next_steps import train_further
from hla_sp.launch.checkpoint.run_config import saved_config
from hla_sp.launch.errors import ConfigError


def dir_bytes(path: str) -> int:
    """Bytes of the files in a checkpoint directory and its DCP subdirectory (links
    are not followed: a checkpoint holds none)."""
    total = 0
    with os.scandir(path) as it:
        for e in it:
            if e.is_dir(follow_symlinks=False):
                total += dir_bytes(e.path)
            elif e.is_file(follow_symlinks=False):
                total += e.stat(follow_symlinks=False).st_size
    return total


# DCP frames every stored tensor (a torch.save record in the data file, an entry in
# .metadata): about 1.7 KiB each, measured with torch 2.13; it only matters for small
# models. A layer holds 12 megatron tensors and about 6 of HLA's (decay, norm, mixes,
# short convolutions).
_ITEM_BYTES, _TENSORS_PER_LAYER = 1750, 18


def estimate_checkpoint_bytes(cfg: Any) -> int:
    """About how many bytes one checkpoint of ``cfg``'s model takes: the weights (in the
    run's precision), fp32 master copies under --bf16/--fp16 and AdamW's two fp32
    moments, from the parameter count of a megatron-core GPT with tied embeddings, and
    DCP's framing of each tensor."""
    from hla_sp.launch.data.datasets import BYTE_VOCAB
    from hla_sp.launch.model.build import padded_vocab_size

    h, heads = cfg.model.hidden_size, cfg.model.num_attention_heads
    kv = h * (cfg.model.num_query_groups or heads) // heads
    ffn = cfg.model.ffn_hidden_size or 4 * h
    vocab = padded_vocab_size(cfg.model.vocab_size or BYTE_VOCAB,
                              cfg.model.make_vocab_size_divisible_by,
                              cfg.parallelism.tensor_model_parallel_size)
    positions = 0
    if cfg.model.position_embedding_type == "learned_absolute":
        positions = cfg.model.max_position_embeddings or cfg.model.seq_length
    layer = (h * (h + 2 * kv) + h + 2 * kv) + (h * h + h) + (2 * h * ffn + ffn + h) + 4 * h
    params = (vocab + positions) * h + cfg.model.num_layers * layer + 2 * h
    half = cfg.precision.bf16 or cfg.precision.fp16
    copies = 4 if half else 3  # weights, (fp32 masters,) two moments: one DCP item each
    items = copies * (cfg.model.num_layers * _TENSORS_PER_LAYER + 4)
    return params * ((2 + 4) if half else 4) + params * 8 + items * _ITEM_BYTES


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
    save, keep = cfg.checkpoint.save, getattr(cfg.checkpoint, "keep_last", None)
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
        load = cfg.checkpoint.load
        mine = load is not None and os.path.isdir(load) and os.path.samefile(load, save)
        if (theirs or os.path.isfile(os.path.join(save, LATEST))) and not mine:
            held = (f"iterations {theirs[0]}..{theirs[-1]}" if len(theirs) > 1
                    else f"iteration {theirs[0]}" if theirs else f"a {LATEST}")
            raise ConfigError(
                f"--save {save}: holds another run's checkpoints ({held}); pass --load "
                f"{save} to resume that run, or --save a new directory")
    # the size of one checkpoint now: the newest on disk, else the model's estimate
    sized = None
    for root in (cfg.checkpoint.load, save):
        done = complete_iterations(root) if root and os.path.isdir(root) else []
        if done:
            sized = (dir_bytes(iter_dir(root, done[-1])), iter_dir(root, done[-1]))
            break
    need, what = sized if sized else (estimate_checkpoint_bytes(cfg), "estimated from the model")
    free = shutil.disk_usage(probe_dir).free
    if free < need:
        raise ConfigError(
            f"--save {save}: {_gib(free)} free on its filesystem, one checkpoint needs about "
            f"{_gib(need)} ({need:,} bytes, {what}){_leftovers(save)}; free space, or --save "
            f"elsewhere")


def _leftovers(save: str) -> str:
    """What an interrupted save (a full disk, a kill) left in ``save`` and what it holds,
    as a clause of the space error: the next save would remove it, but only after this
    check, so the user is told to (it is not removed here: another run may be writing)."""
    found = sorted(glob.glob(os.path.join(glob.escape(save), "iter_*.tmp")))
    found = [d for d in found if os.path.isdir(d) and not os.path.islink(d)]
    if not found:
        return ""
    size = sum(dir_bytes(d) for d in found)
    names = ", ".join(os.path.basename(d) for d in found)
    return (f"; {names} in it ({_gib(size)}) is left over from an interrupted save: delete "
            f"it if no other run is saving there (rm -r {' '.join(found)})")


# the schedule flags Megatron's OptimizerParamScheduler checks on load, as trainer flags
_SCHEDULE = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_style", "weight_decay")


def schedule_diff(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``--flag SAVED (checkpoint) != NOW (this run)`` for each learning-rate schedule
    value that differs, the decay length included (--lr-decay-iters, which defaults to
    --train-iters); values the checkpoint does not record are not compared. Either
    config may be in sections or in the flat form of earlier versions."""
    from hla_sp.launch.config.train_config import flat_config

    saved, now = flat_config(saved), flat_config(now)
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
    override = getattr(cfg.checkpoint, "override_opt_param_scheduler", False)
    use_ckpt = getattr(cfg.checkpoint, "use_checkpoint_opt_param_scheduler", False)
    if override and use_ckpt:
        raise ConfigError(
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude "
            "each other: pass the one that says whose schedule to trust")
    try:
        it = resume_iteration(cfg.checkpoint.load, cfg.checkpoint.ckpt_step)
        saved = saved_config(cfg.checkpoint.load, it) if it is not None else None
    except CheckpointError as e:
        raise ConfigError(f"--load {cfg.checkpoint.load}: {e}") from None
    # --skip-train takes no step, so the schedule it would resume does not matter
    if saved is None or override or use_ckpt or getattr(cfg.evaluation, "skip_train", False):
        return
    diff = schedule_diff(saved, cfg.to_dict())
    if diff:
        raise ConfigError(
            f"--load {cfg.checkpoint.load}: the checkpoint at iteration {it} has another "
            f"learning-rate schedule: " + "; ".join(diff) + ". Pass "
            "--use-checkpoint-opt_param-scheduler to "
            "keep the checkpoint's, or --override-opt_param-scheduler to apply this run's "
            "(Megatron's flags)")


def nothing_to_do(cfg: Any) -> str | None:
    """The line for a resume that has nothing left to train (the checkpoint in --load is
    at or past --train-iters), ending with the flags that train further
    (:func:`hla_sp.launch.checkpoint.next_steps.train_further`); None when there is
    training to do."""

    if getattr(cfg.evaluation, "skip_train", False) or cfg.checkpoint.load is None:
        return None
    resume = resume_iteration(cfg.checkpoint.load, cfg.checkpoint.ckpt_step)
    if resume is None or resume < cfg.optimizer.train_iters:
        return None
    return (f"nothing to do: the checkpoint in {cfg.checkpoint.load} is at iteration {resume}, "
            f"and --train-iters is {cfg.optimizer.train_iters}; {train_further(cfg, resume)}")


def check_resume_layout(cfg: Any) -> None:
    """A checkpoint of the first format (one file per TP rank) resumes only at the TP
    size that wrote it: refused here, before any process group, saying how to convert
    it. The current format loads at any TP, CP and DP size."""
    try:
        it = resume_iteration(cfg.checkpoint.load, cfg.checkpoint.ckpt_step)
    except CheckpointError:
        return  # check_resume_schedule has said why
    if it is None:
        return
    d = checkpoint_dir(cfg.checkpoint.load, it)
    if os.path.isfile(os.path.join(d, COMMON)) or not os.path.isfile(
            os.path.join(d, LEGACY_MODEL)):
        return
    why = legacy.tp_mismatch(d, cfg.parallelism.tensor_model_parallel_size)
    if why:
        raise ConfigError(f"--load {cfg.checkpoint.load}: {why}")


def preflight(cfg: Any) -> None:
    """Everything about --save and --load that can fail later, checked before training
    (no process group, nothing written): :func:`check_save_dir`,
    :func:`check_resume_schedule` and :func:`check_resume_layout`; and that no other
    run holds --save (:func:`~hla_sp.launch.checkpoint.lock.check_save_lock`)."""
    check_save_dir(cfg)
    check_save_lock(cfg.checkpoint.save, getattr(cfg.checkpoint, "break_save_lock", False))
    check_resume_schedule(cfg)
    check_resume_layout(cfg)

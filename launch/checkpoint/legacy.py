"""Checkpoints of the first format, read back: one ``model_optim_tpNN.pt`` per
tensor-parallel rank (``torch.save`` of the module's and optimizer's own state dicts).

Those files hold each TP rank's slices without saying where they sit in the whole
tensors, so they load only at the TP size that wrote them; saving once after such a
resume writes the current format, which reshards.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

import torch
from hla_sp.launch.checkpoint.layout import CheckpointError, read_torch_file
from hla_sp.launch.checkpoint.rng import restore_rng

_KEYS = ("model", "optimizer", "scheduler", "iteration", "consumed_samples", "world_size")
_FILE = re.compile(r"model_optim_tp(\d+)\.pt")


def saved_tp(d: str) -> int:
    """How many TP ranks wrote the old-format checkpoint ``d`` (its model files)."""
    names = (os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(d), "*.pt")))
    return sum(1 for n in names if _FILE.fullmatch(n))


def tp_mismatch(d: str, tp: int) -> str | None:
    """Why the old-format checkpoint ``d`` cannot load at TP size ``tp`` (one line that
    says how to convert it), or None when it can."""
    wrote = saved_tp(d)
    if wrote == tp:
        return None
    return (f"{d}: written in the first checkpoint format (model_optim_tpNN.pt) by {wrote} "
            f"tensor-parallel ranks, which loads only at --tensor-model-parallel-size "
            f"{wrote} (this run has {tp}); to convert it, resume there once with --save and "
            f"--exit-interval at the next iteration: that checkpoint reshards")


def load(
    d: str,
    *,
    rank: int,
    world_size: int,
    tp_rank: int,
    tp: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
) -> dict[str, Any]:
    """Restore an old-format checkpoint directory ``d`` at TP size ``tp``; refused in one
    line at another TP size, saying how to convert it."""
    why = tp_mismatch(d, tp)
    if why:
        raise CheckpointError(why)
    path = os.path.join(d, f"model_optim_tp{tp_rank:02d}.pt")
    state = read_torch_file(path, "model and optimizer state")
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise CheckpointError(f"{path}: missing entries {missing}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    restore_rng(d, rank, {"world_size": state["world_size"]}, {"world_size": world_size})
    known = {*_KEYS, "config"}
    return {"iteration": state["iteration"], "consumed_samples": state["consumed_samples"],
            "extra": {k: v for k, v in state.items() if k not in known}}

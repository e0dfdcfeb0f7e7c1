"""Every RNG the run touches, saved per rank so that a resume at the same layout is
bitwise (dropout masks continue where they stopped)."""

from __future__ import annotations

import os
import random
import warnings
from typing import Any

import numpy as np
import torch
from hla_sp.launch.checkpoint.layout import CheckpointError, read_torch_file, warn_once


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



def _sizes(layout: dict[str, int]) -> str:
    parts = ", ".join(f"{k.upper()} {layout[k]}" for k in ("tp", "cp", "dp") if k in layout)
    return f"{layout['world_size']} ranks" + (f" ({parts})" if parts else "")


def restore_rng(d: str, rank: int, saved: dict[str, int], now: dict[str, int]) -> None:
    """Set this rank's RNGs from checkpoint directory ``d`` when the run has the layout
    that wrote it (the sizes ``saved`` records); otherwise, or without the file, keep
    the fresh streams and say that the resume is not bitwise."""
    path = os.path.join(d, f"rng_rank{rank:05d}.pt")
    if any(now.get(k) != v for k, v in saved.items()):
        # every rank sees the same layouts: one line, from rank 0
        warn_once(
            f"checkpoint {d} was written by {_sizes(saved)}, this run has {_sizes(now)}: "
            f"model, optimizer, scheduler and data position resume, RNG streams are "
            f"reseeded, so the resume is not bitwise (dropout masks will differ from an "
            f"uninterrupted run)")
    elif not os.path.isfile(path):
        warnings.warn(
            f"{path} is missing (rank {rank}'s RNG state): model, optimizer, scheduler "
            f"and data position resume, but this rank's RNG streams are reseeded, so the "
            f"resume is no longer bitwise (dropout masks will differ from an uninterrupted "
            f"run)",
            stacklevel=3,
        )
    else:
        state = read_torch_file(path, f"RNG state of rank {rank}")
        if "rng" not in state:
            raise CheckpointError(f"{path}: no 'rng' entry (keys {sorted(state)})")
        set_rng_state(state["rng"])

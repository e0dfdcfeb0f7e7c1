"""Checkpoints: atomic, resumable bit for bit, and resharding (another TP, CP or DP size).

Layout (a shared filesystem is assumed, as Megatron does)::

    SAVE/latest_checkpointed_iteration.txt     written last; names a complete iter_ dir
    SAVE/iter_0000042/common.pt                rank 0: iteration, data position, scheduler,
                                               optimizer settings and step, loss scale,
                                               the iteration's loss and validation loss
    SAVE/iter_0000042/config.json              rank 0: the run's flags (--load compares them)
    SAVE/iter_0000042/model_optim/             torch.distributed.checkpoint (DCP): weights,
                                               fp32 masters, optimizer moments, whole tensors
    SAVE/iter_0000042/rng_rank00003.pt         one per rank: torch, CUDA, python, numpy RNG
    SAVE/iter_0000042/manifest.json            rank 0, last: every file's size and SHA-256,
                                               the iteration (:mod:`.manifest`; a load
                                               verifies them)
    SAVE/save.lock                             the run writing here (:mod:`.lock`)

The model and optimizer tensors are saved as pieces of global tensors, named and placed
by megatron-core's ``sharded_state_dict`` (:mod:`.sharded`), so a checkpoint loads at
another tensor-, context- or data-parallel size: each rank reads the parts of the saved
tensors that it holds now. RNG states resume only at the layout that wrote them (they
are reseeded otherwise, with a warning). Checkpoints of the first format (one
``model_optim_tpNN.pt`` per TP rank) still load, at their TP size (:mod:`.legacy`).

All ranks write into ``iter_0000042.tmp``; after a barrier rank 0 renames the directory
and only then rewrites ``latest``. A crash at any point leaves the previous checkpoint
as the latest, never a half-written one. Re-saving an iteration that exists moves the
old copy aside (``iter_0000042.old``) and renames the new one in: nothing is deleted
before its replacement is in place, and an interrupted swap is undone by the next save
or read by the next resume. When ``latest`` names a missing or incomplete directory, a
resume falls back to the newest complete checkpoint, with a one-line warning.
"""

from __future__ import annotations

import shutil  # noqa: F401  (tests patch checkpoint.shutil's functions)

from hla_sp.launch.checkpoint.layout import (
    COMMON,
    CONFIG,
    LATEST,
    LEGACY_MODEL,
    SHARDED,
    CheckpointError,
    checkpoint_dir,
    complete_iterations,
    is_complete,
    iter_dir,
    latest_iteration,
    resume_iteration,
)
from hla_sp.launch.checkpoint.lock import (
    LOCK,
    SaveLock,
    SaveLockError,
    check_save_lock,
    hold,
)
from hla_sp.launch.checkpoint.lock import release_all as release_save_locks
from hla_sp.launch.checkpoint.manifest import MANIFEST, newest_finite, verify
from hla_sp.launch.checkpoint.preflight_checks import (
    check_resume_layout,
    check_resume_schedule,
    check_save_dir,
    dir_bytes,
    estimate_checkpoint_bytes,
    preflight,
    schedule_diff,
)
from hla_sp.launch.checkpoint.rng import rng_state, set_rng_state
from hla_sp.launch.checkpoint.run_config import check_config_dict, load_run_config, saved_config
from hla_sp.launch.checkpoint.store import load, load_weights, save

__all__ = [
    "COMMON",
    "CONFIG",
    "LATEST",
    "LEGACY_MODEL",
    "LOCK",
    "MANIFEST",
    "SHARDED",
    "CheckpointError",
    "SaveLock",
    "SaveLockError",
    "check_config_dict",
    "check_resume_layout",
    "check_resume_schedule",
    "check_save_dir",
    "check_save_lock",
    "checkpoint_dir",
    "complete_iterations",
    "dir_bytes",
    "estimate_checkpoint_bytes",
    "hold",
    "is_complete",
    "iter_dir",
    "latest_iteration",
    "load",
    "load_run_config",
    "load_weights",
    "newest_finite",
    "preflight",
    "release_save_locks",
    "resume_iteration",
    "rng_state",
    "save",
    "saved_config",
    "schedule_diff",
    "set_rng_state",
    "verify",
]

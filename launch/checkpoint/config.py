"""The checkpoints' config section, [checkpoint]: --save, --load, intervals, what a
resume restores. The checkpoint to resume is checked by :mod:`.resume_checks`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hla_sp.launch.config.sections import Range, Section
from hla_sp.launch.errors import ConfigError

__all__ = ["CheckpointConfig"]


@dataclass
class CheckpointConfig(Section):
    """Saving, resuming and stopping ([checkpoint])."""

    save: str | None = None
    """Directory to write checkpoints to (atomically)."""
    load: str | None = None
    """Directory to resume from (its latest complete checkpoint)."""
    ckpt_step: int | None = None
    """With --load: resume from this iteration's checkpoint instead of the latest."""
    keep_last: int | None = None
    """Keep only the newest this many checkpoints in --save; older ones are deleted once
    a newer one is complete (default: keep every checkpoint). The newest finite
    checkpoint and the one this run resumed from are never deleted."""
    break_save_lock: bool = False
    """Take --save's lock (save.lock) even though another run holds it: for a lock left
    by a run on another host that no longer runs (one on this host whose process is gone
    is taken over anyway)."""
    override_opt_param_scheduler: bool = False
    """On resume, apply this run's learning-rate schedule flags instead of the
    checkpoint's (Megatron's --override-opt_param-scheduler)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, keep the checkpoint's learning-rate schedule, whatever this run's flags
    say (Megatron's --use-checkpoint-opt_param-scheduler). Without either flag a changed
    --lr, --min-lr, --lr-warmup-iters, --lr-decay-style, --weight-decay or decay length
    (--lr-decay-iters, default --train-iters) is refused with the difference."""
    save_interval: int | None = None
    """Save every this many iterations (and always at the end when --save is set)."""
    exit_interval: int | None = None
    """Stop (saving first when --save is set) once the iteration is a multiple of this."""
    exit_signal_handler: bool = False
    """On SIGINT or SIGTERM, finish the current iteration, save (with --save), draw the
    plot and print the command that resumes (Megatron's --exit-signal-handler). Without
    it a signal stops the run at once, with one line and no checkpoint."""

    RANGES: ClassVar[dict[str, Range]] = {
        "ckpt_step": ("[", 0, None, "]"),
    }

    def validate(self) -> None:
        """Ranges; the save and exit intervals >= 1."""
        super().validate()
        for name in ("save_interval", "exit_interval"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")

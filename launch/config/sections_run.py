"""The trainer's config sections for the run around the model: data, evaluation,
checkpoints and logging (see :mod:`hla_sp.launch.config.sections` for the others).

Each section checks here only what its own flags show; what needs the world size, the
files or the installed packages is checked by :mod:`hla_sp.launch.checks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hla_sp.launch.config.sections import Range, Section
from hla_sp.launch.errors import ConfigError

__all__ = ["RECALL_FILLERS", "CheckpointConfig", "DataConfig", "EvaluationConfig",
           "LoggingConfig", "split_weights"]

# The filler layouts of --data synthetic-recall (launch/data/datasets.py's RecallSamples).
RECALL_FILLERS = ("random", "constant")


def split_weights(split: str) -> tuple[float, float, float]:
    """Megatron's ``--split`` ("969,30,1", "90,10" or "100") as fractions summing to 1."""
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or any(not x >= 0 for x in parts) or sum(parts) <= 0:
        raise ConfigError(
            f"--split: expected up to three weights train,valid,test such as 969,30,1, "
            f"got {split!r}"
        )
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return parts[0] / total, parts[1] / total, parts[2] / total


@dataclass
class DataConfig(Section):
    """The training data and its split ([data])."""

    data: str = "text"
    """text (Megatron data from --data-path, else the Python standard library's sources
    as bytes) or synthetic-recall (key-value pairs early, queried in the second half;
    the loss can only fall below ln(64) if information crosses context-parallel ranks)."""
    data_path: list[str] | None = None
    """Prefixes of Megatron indexed datasets (PREFIX.bin and PREFIX.idx), concatenated;
    or weight-prefix pairs as Megatron takes them (0.5 A 0.5 B), blended by weight."""
    recall_pairs: int = 8
    """Key-value pairs per sample for --data synthetic-recall."""
    recall_filler: str = "random"
    """The tokens around the pairs and queries of --data synthetic-recall: random (a
    fresh id per position, so the state must also learn to ignore noise) or constant
    (one id everywhere, the filler of Zoology's MQAR)."""
    split: str = "969,30,1"
    """Train, validation and test weights of the data (Megatron's --split): the first
    share of the samples trains, the next is the held-out validation set."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "data": ("text", "synthetic-recall"),
        "recall_filler": RECALL_FILLERS,
    }

    @property
    def split_weights(self) -> tuple[float, float, float]:
        """--split as train, valid and test fractions summing to 1."""
        return split_weights(self.split)

    def validate(self) -> None:
        """The choices, --split, and --data-path only with --data text."""
        super().validate()
        split_weights(self.split)
        if self.data_path and self.data != "text":
            raise ConfigError("--data-path goes with --data text; drop one of them.")


@dataclass
class EvaluationConfig(Section):
    """Validation on the held-out split ([evaluation])."""

    eval_interval: int | None = None
    """Compute the validation loss every this many iterations and at the end (default:
    never)."""
    eval_iters: int = 10
    """Global batches of the validation split per evaluation (the same ones each time)."""
    skip_train: bool = False
    """Train nothing: evaluate the checkpoint in --load (or --ckpt-step) once on the
    held-out split that --seed and the data flags give, print the result, log it to
    --log-jsonl as an "evaluation" event, and exit (Megatron's --skip-train). The
    checkpoint may come from another TP, CP or DP size."""

    RANGES: ClassVar[dict[str, Range]] = {
        "eval_interval": ("[", 1, None, "]"),
        "eval_iters": ("[", 1, None, "]"),
    }


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


@dataclass
class LoggingConfig(Section):
    """Progress lines, logs, TensorBoard, W&B and MFU ([logging])."""

    log_interval: int = 1
    """Print a progress line every this many iterations (rank 0)."""
    log_jsonl: str | None = None
    """Append one JSON object per iteration to this file (rank 0); a line with "event":
    "start" marks where each run (or resumed run) begins. At the end of the run a plot of
    loss and throughput goes next to it (same name, .png; needs matplotlib), redrawn
    every --log-interval iterations while the run goes."""
    tensorboard_dir: str | None = None
    """Write loss, learning rate, gradient norm, throughput and memory as TensorBoard
    scalars to this directory (rank 0; needs pip install "hla-sp[tensorboard]")."""
    wandb_project: str | None = None
    """Log the same scalars and the config to this Weights & Biases project (rank 0;
    needs the wandb package)."""
    wandb_exp_name: str | None = None
    """With --wandb-project: the run's name (default: wandb's)."""
    peak_tflops: float | None = None
    """The device's peak TFLOP/s, for the model FLOPs utilisation (MFU) of the progress
    line and the logs. Default: the dense peak of a known GPU at the run's precision
    (H100/H200: 989 with --bf16/--fp16, 495 tf32; A100: 312, 156); none on a CPU or an
    unknown device, which then logs no MFU."""

    def validate(self) -> None:
        """--log-interval >= 1; a W&B run name goes with a W&B project."""
        super().validate()
        if self.log_interval is not None and self.log_interval < 1:
            raise ConfigError(f"--log-interval must be >= 1, got {self.log_interval}")
        if self.wandb_exp_name and not self.wandb_project:
            raise ConfigError(
                f"--wandb-exp-name {self.wandb_exp_name}: goes with --wandb-project NAME, "
                f"got none"
            )

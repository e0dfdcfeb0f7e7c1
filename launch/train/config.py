"""The training loop's config sections: [optimizer] (batching, schedule, AdamW, the
seed), [precision], [evaluation], [logging] and [performance] (``--compile``,
``--profile``). Each checks what its own flags show; what needs other sections or the
world size is checked by :mod:`hla_sp.launch.checks`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hla_sp.launch.config.sections import FP32_MAX, Range, Section
from hla_sp.launch.errors import ConfigError

__all__ = ["EvaluationConfig", "LoggingConfig", "OptimizerConfig", "PerformanceConfig",
           "PrecisionConfig"]


@dataclass
class OptimizerConfig(Section):
    """Batching, iterations, the learning-rate schedule, AdamW and the seed
    ([optimizer])."""

    micro_batch_size: int = 1
    """Samples per microbatch on each data-parallel rank."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all data-parallel ranks (default: micro-batch
    size x data-parallel size); the rest is gradient accumulation."""
    train_iters: int = 20
    """Optimizer steps to train for."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the decay."""
    lr_warmup_iters: int = 0
    """Linear warmup steps from 0 to --lr."""
    lr_decay_iters: int | None = None
    """Steps over which the learning rate decays to --min-lr (default: --train-iters)."""
    lr_decay_style: str = "cosine"
    """cosine, linear or constant."""
    weight_decay: float = 0.01
    """AdamW weight decay (not applied to biases and norms)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    check_for_nan_in_loss_and_grad: bool = True
    """Stop the run when the loss or the gradient norm is NaN or infinite, before the
    optimizer steps and with nothing saved, naming the iteration, the value and the last
    finite checkpoint (Megatron's flag; --no-check-for-nan-in-loss-and-grad trains on).
    An fp16 overflow stays a skipped step."""
    seed: int = 1234
    """Seed for initialisation, dropout and data order."""
    use_distributed_optimizer: bool = False
    """Shard the fp32 master weights, their gradients and AdamW's moments (16 bytes a
    parameter) over the data- and context-parallel ranks (Megatron's flag; torch FSDP2
    underneath); the step's whole weights and gradients stay. Same losses as without,
    to fp32 rounding of the reduction order."""

    RANGES: ClassVar[dict[str, Range]] = {
        "micro_batch_size": ("[", 1, None, "]"),
        "global_batch_size": ("[", 1, None, "]"),
        "lr": ("[", 0, None, "]"),
        "min_lr": ("[", 0, None, "]"),
        "lr_warmup_iters": ("[", 0, None, "]"),
        "lr_decay_iters": ("[", 1, None, "]"),
        "weight_decay": ("[", 0, None, "]"),
        "adam_beta1": ("[", 0, 1, ")"),
        "adam_beta2": ("[", 0, 1, ")"),
        "adam_eps": ("(", 0, None, "]"),
        "clip_grad": ("[", 0, None, "]"),
        "seed": ("[", 0, 2**32 - 1, "]"),
    }
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "lr_decay_style": ("cosine", "linear", "constant"),
    }

    @property
    def decay_iters(self) -> int:
        """The decay length: --lr-decay-iters, default --train-iters."""
        return self.lr_decay_iters or self.train_iters

    def validate(self) -> None:
        """Ranges, iterations and the learning-rate schedule."""
        super().validate()
        if self.train_iters < 1:
            raise ConfigError(f"--train-iters must be >= 1, got {self.train_iters}")
        decay = self.decay_iters
        if self.lr_warmup_iters >= decay and self.lr_decay_style != "constant":
            raise ConfigError(
                f"--lr-warmup-iters {self.lr_warmup_iters} must be < the decay length {decay} "
                f"(--lr-decay-iters, default --train-iters)."
            )
        if self.min_lr > self.lr:
            raise ConfigError(f"--min-lr {self.min_lr} must be <= --lr {self.lr}.")
        # AdamW's first step moves the fp32 masters by --lr / (1 - beta1) (its bias
        # correction); past fp32's largest number the optimizer raises mid-step.
        most = FP32_MAX * (1.0 - self.adam_beta1)
        if self.lr > most:
            raise ConfigError(
                f"--lr: expected at most {most:.3g} (AdamW's first step is --lr / "
                f"(1 - --adam-beta1) = {self.lr / (1.0 - self.adam_beta1):.3g}, past fp32's "
                f"largest number), got {self.lr:g}"
            )


@dataclass
class PrecisionConfig(Section):
    """Megatron's mixed precision: fp32 master weights and grads ([precision])."""

    bf16: bool = False
    """Run the model in bfloat16; the optimizer keeps fp32 master weights and
    gradients are accumulated, reduced and clipped in fp32 (Megatron's --bf16)."""
    fp16: bool = False
    """Run the model in float16 with fp32 master weights and a loss scale (dynamic
    unless --loss-scale is set); steps whose gradients overflow are skipped."""
    loss_scale: float | None = None
    """With --fp16: a static loss scale (default: dynamic)."""
    initial_loss_scale: float = 2.0**32
    """With --fp16: the dynamic loss scale's initial value."""
    min_loss_scale: float = 1.0
    """With --fp16: the dynamic loss scale never goes below this."""
    loss_scale_window: int = 1000
    """With --fp16: steps without overflow before the dynamic scale doubles."""
    hysteresis: int = 2
    """With --fp16: overflowing steps tolerated before the dynamic scale halves."""

    RANGES: ClassVar[dict[str, Range]] = {
        "loss_scale": ("(", 0, None, "]"),
        "initial_loss_scale": ("(", 0, None, "]"),
        "min_loss_scale": ("(", 0, None, "]"),
        "loss_scale_window": ("[", 1, None, "]"),
        "hysteresis": ("[", 1, None, "]"),
    }

    @property
    def half(self) -> bool:
        """Whether the model runs in 16 bits (--bf16 or --fp16)."""
        return self.bf16 or self.fp16

    def validate(self) -> None:
        """Ranges; one half type at most."""
        super().validate()
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 exclude each other; pass one of them.")


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


@dataclass
class PerformanceConfig(Section):
    """Compiling the layers and profiling steps ([performance])."""

    compile: bool = False
    """torch.compile each transformer layer with fullgraph=True (inductor), inside the
    full-recompute wrapper (selective recompute is traced into the layer's graph); a graph
    break stops the run at the first step, which pays the compilation (tens of seconds to
    minutes on CPU). Refused with tensor parallelism, which does not trace whole."""
    profile: bool = False
    """Record torch.profiler traces (CPU, plus CUDA on GPU) of the steps from
    --profile-step-start to --profile-step-end on each of --profile-ranks, one Chrome
    trace per rank, <--tensorboard-dir, else --save>/profile/rank<R>.steps<N>-<M>.pt.trace.json
    (chrome://tracing, Perfetto). Profiled steps run slower; the others pay nothing."""
    profile_step_start: int = 10
    """With --profile: the first profiled step, counted from 0 as Megatron does (step N
    is the one that logs iteration N + 1); the profiler warms up on the step before."""
    profile_step_end: int = 12
    """With --profile: the step after the last profiled one (steps start to end - 1)."""
    profile_ranks: list[int] | None = None
    """With --profile: the global ranks that record a trace (default: rank 0)."""
    profile_record_shapes: bool = False
    """With --profile: record each op's input shapes (larger traces, more overhead)."""

    RANGES: ClassVar[dict[str, Range]] = {
        "profile_step_start": ("[", 0, None, "]"),
        "profile_step_end": ("[", 1, None, "]"),
    }

    @property
    def ranks(self) -> list[int]:
        """The ranks that record a trace (--profile-ranks, default rank 0)."""
        return list(self.profile_ranks) if self.profile_ranks is not None else [0]

    def validate(self) -> None:
        """Ranges; the profiled steps in order."""
        super().validate()
        if self.profile and self.profile_step_end <= self.profile_step_start:
            raise ConfigError(
                f"--profile-step-end: expected > --profile-step-start "
                f"{self.profile_step_start}, got {self.profile_step_end}")

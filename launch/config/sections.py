"""The trainer's config sections for the model and its training: one dataclass each,
one docstring per field, which is the flag's ``--help``; each checks what it can alone.

:class:`ModelConfig` (with ``--attention``, ``--hla-layer-pattern`` and
``--custom-import``, whose flags :func:`hla_sp.megatron_patch.add_hla_args` defines),
:class:`OptimizerConfig` (batching, schedule, AdamW, the seed), :class:`PrecisionConfig`
and :class:`ParallelismConfig`. The run's sections (data, evaluation, checkpoints,
logging) are in :mod:`hla_sp.launch.config.sections_run`;
:class:`hla_sp.launch.config.train_config.TrainConfig` holds them all, and
:mod:`hla_sp.launch.checks` checks them against each other.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hla_sp.launch.errors import ConfigError

__all__ = ["HLA_FLAG", "ModelConfig", "OptimizerConfig", "ParallelismConfig",
           "PrecisionConfig", "Section", "check_ranges"]

# Field metadata of a model field whose flag add_hla_args / add_hybrid_args defines
# (the one definition of the HLA flags, which Megatron's pretrain_gpt shares).
HLA_FLAG = {"hla_flag": True}

FP32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max, without importing torch

# (lo, hi) ends: "[" / "(" closed / open; hi None: unbounded. None values are skipped.
Range = tuple[str, float, float | None, str]


def check_ranges(section: Any) -> None:
    """Every numeric field of ``section`` in its ``RANGES`` entry, finite, named as the
    flag it is on the command line."""
    for name, (lb, lo, hi, rb) in section.RANGES.items():
        v = getattr(section, name)
        if v is None:
            continue
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        ok = ok and (v >= lo if lb == "[" else v > lo)
        if hi is not None:
            ok = ok and (v <= hi if rb == "]" else v < hi)
        if not ok:
            want = f"{lb}{lo}, {'inf' if hi is None else hi}{rb}"
            raise ConfigError(
                f"--{name.replace('_', '-')}: expected a finite value in {want}, got {v!r}"
            )


class Section:
    """What every section has: its ranges and choices, and :meth:`validate`."""

    RANGES: ClassVar[dict[str, Range]] = {}
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {}

    def validate(self) -> None:
        """Refuse, in one line naming the flag, what this section alone shows is wrong."""
        check_ranges(self)
        for name, choices in self.CHOICES.items():
            v = getattr(self, name)
            if v is not None and v not in choices:
                raise ConfigError(f"--{name.replace('_', '-')}: expected one of "
                                  f"{list(choices)}, got {v!r}")

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-friendly dict."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# Above this many positions a learned table (positions x hidden parameters, trained from
# one sample per position per step) outweighs what it buys: RoPE, or no positions with
# HLA's decay, cost nothing per position. 65,536 x 2048 is already 134 M parameters.
MAX_LEARNED_POSITIONS = 65536


@dataclass
class ModelConfig(Section):
    """The model's shape, positions, dropout, recompute and attention ([model])."""

    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Transformer hidden size."""
    num_attention_heads: int = 4
    """Number of attention (query) heads."""
    num_query_groups: int | None = None
    """Key/value head groups for GQA (default: one per head)."""
    ffn_hidden_size: int | None = None
    """MLP hidden size (default: 4 x hidden size)."""
    seq_length: int = 256
    """Tokens per sample. With context parallelism it must be divisible by
    2 x context-parallel-size (Megatron's zigzag split)."""
    max_position_embeddings: int | None = None
    """Size of the learned position table (default: seq-length)."""
    position_embedding_type: str = "learned_absolute"
    """learned_absolute, rope or none. rope needs CUDA (megatron-core's rotary embedding
    runs on the current CUDA device) and is refused on CPU; HLA with decay needs no
    positions, and none saves seq-length x hidden parameters at long context."""
    rotary_base: int = 10000
    """Base of the rotary embedding's frequencies (--position-embedding-type rope)."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that RoPE rotates."""
    vocab_size: int | None = None
    """Vocabulary size before padding: the tokenizer's, as in Megatron (default: 257, the
    byte-level tokens of the built-in data and of make_dataset). The data is not scanned
    for it; a token id outside it is refused when read, naming the file."""
    tokenizer: str | None = None
    """make-dataset's --tokenizer (bytes, a path or a hub name); gives --vocab-size's default."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times the tensor-parallel size."""
    hidden_dropout: float = 0.0
    """Dropout after attention and MLP. Megatron defaults to 0.1; 0 is the usual choice
    for pretraining and keeps runs comparable across CP sizes."""
    attention_dropout: float = 0.0
    """Dropout inside core attention (passed to the core attention)."""
    init_method_std: float = 0.02
    """Standard deviation of the weight initialisation."""
    recompute_activations: bool = False
    """Recompute core attention in backward (Megatron's selective recompute)."""
    recompute_granularity: str | None = None
    """full (recompute every transformer layer; the least memory) or selective."""
    loss_chunk_tokens: int | None = None
    """Compute the output layer and cross-entropy this many tokens at a time, so the
    fp32 logits of all the rank's tokens never exist at once (backward recomputes each
    chunk's logits). 0: the plain path (all logits). Default (auto): 4096 when a rank
    holds more tokens than that (micro-batch x seq-length / CP), else the plain path."""

    attention: str = field(default="hla2", metadata=HLA_FLAG)
    """The core attention: softmax, or an HLA operator (hla2, ahla, hla3, ccq, or one a
    --custom-import module registered) in every layer's core-attention slot."""
    hla_layer_pattern: int | list[int] | None = field(default=None, metadata=HLA_FLAG)
    """Which layers run HLA (1) and which softmax (0): an int N (every N-th layer
    softmax) or the per-layer list; None: every layer HLA."""
    custom_import: list[str] = field(default_factory=list, metadata=HLA_FLAG)
    """Modules imported first in the launcher and every worker; the operators they
    register are --attention's choices."""

    RANGES: ClassVar[dict[str, Range]] = {
        "num_layers": ("[", 1, None, "]"),
        "hidden_size": ("[", 1, None, "]"),
        "num_attention_heads": ("[", 1, None, "]"),
        "num_query_groups": ("[", 1, None, "]"),
        "ffn_hidden_size": ("[", 1, None, "]"),
        "max_position_embeddings": ("[", 1, None, "]"),
        "vocab_size": ("[", 1, None, "]"),
        "make_vocab_size_divisible_by": ("[", 1, None, "]"),
        "hidden_dropout": ("[", 0, 1, ")"),
        "attention_dropout": ("[", 0, 1, ")"),
        "init_method_std": ("(", 0, None, "]"),
        "rotary_base": ("[", 1, None, "]"),
        "rotary_percent": ("(", 0, 1, "]"),
        "loss_chunk_tokens": ("[", 0, None, "]"),
    }
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "position_embedding_type": ("learned_absolute", "rope", "none"),
        "recompute_granularity": ("full", "selective"),
    }

    @property
    def query_groups(self) -> int:
        """Key/value head groups as built (--num-query-groups, default one per head)."""
        return self.num_query_groups or self.num_attention_heads

    def validate(self) -> None:
        """Ranges; heads split the hidden size and groups the heads; the position table."""
        super().validate()
        if self.seq_length < 2:
            raise ConfigError(f"--seq-length must be >= 2, got {self.seq_length}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}; pick heads in {_divisors(self.hidden_size)}."
            )
        groups = self.query_groups
        if self.num_attention_heads % groups:
            raise ConfigError(
                f"--num-query-groups {groups} does not divide --num-attention-heads "
                f"{self.num_attention_heads}; pick one of {_divisors(self.num_attention_heads)}."
            )
        self._check_position_table()

    def _check_position_table(self) -> None:
        if self.position_embedding_type != "learned_absolute":
            return
        mpe = self.max_position_embeddings or self.seq_length
        if max(mpe, self.seq_length) > MAX_LEARNED_POSITIONS:
            n = mpe * self.hidden_size
            raise ConfigError(
                f"--position-embedding-type learned_absolute at --seq-length "
                f"{self.seq_length:,}: the position table would be {mpe:,} x {self.hidden_size} "
                f"= {n / 1e9:.2f} B parameters; above {MAX_LEARNED_POSITIONS:,} positions use "
                f"--position-embedding-type rope (CUDA) or none (HLA's decay orders tokens)."
            )
        if mpe < self.seq_length:
            raise ConfigError(
                f"--max-position-embeddings {mpe} < --seq-length {self.seq_length}; raise it, "
                f"or use --position-embedding-type none."
            )


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
class ParallelismConfig(Section):
    """The parallel layout and the process group ([parallelism])."""

    context_parallel_size: int = 1
    """Ranks that share one sequence (HLA's exact scan runs across them)."""
    tensor_model_parallel_size: int = 1
    """Ranks that share each weight matrix (Megatron tensor parallelism)."""
    distributed_timeout_minutes: float = 10.0
    """Process-group timeout: a hung or dead peer ends every rank after this long."""

    RANGES: ClassVar[dict[str, Range]] = {
        "context_parallel_size": ("[", 1, None, "]"),
        "tensor_model_parallel_size": ("[", 1, None, "]"),
        "distributed_timeout_minutes": ("(", 0, None, "]"),
    }

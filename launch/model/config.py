"""The model's config section, [model]: its shape, positions, dropout, recompute and
attention (with ``--attention``, ``--hla-layer-pattern`` and ``--custom-import``, whose
flags :func:`hla_sp.megatron_patch.add_hla_args` defines); what it shows alone is
checked by :meth:`ModelConfig.validate`, the rest by :mod:`hla_sp.launch.checks`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from hla_sp.launch.config.sections import HLA_FLAG, Range, Section
from hla_sp.launch.errors import ConfigError

__all__ = ["MAX_LEARNED_POSITIONS", "ModelConfig"]


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

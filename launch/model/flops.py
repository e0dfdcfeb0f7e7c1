"""Model FLOPs of a GPT with softmax or linear (HLA) core attention, per token.

Megatron's own count (its "TFLOP/s/GPU") takes every layer's core attention to be
softmax's, quadratic in the sequence; for an HLA model that is wrong by a factor that
grows with T. These functions count what each attention computes, 2 FLOPs per
multiply-add, forward only; training is 3x the forward (backward = 2x), recomputation
not counted, as MFU is defined.

- softmax, causal: each query meets T/2 keys on average: T (K + V) per token and head.
- an HLA operator (``hla_sp.ops.operators``): every 2-D field of its state
  (``OperatorSpec.fields``, e.g. hla2's S [K, K] and H [K, V]) is one pass of the
  chunked primitive with that key and value width D (K = V = the head width here):
    - the state update k^T v: 2 K D per token, once per head that owns the state (kv heads
      for a "kv" field, query heads for a "q" field);
    - the inter-chunk read-out q h: 2 K D per token and query head;
    - the intra-chunk causal part (scores q k^T and their mixing with the values over
      C / 2 keys on average): C (K + D) per token and query head, C the chunk length.
  1-D fields (hla2's normaliser eta) cost O(K) and are left out.
"""

from __future__ import annotations

DEFAULT_CHUNK = 64


def _check_pos(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def attention_flops_per_token(attention: str, seq_length: int, heads: int, kv_heads: int,
                              head_dim: int, chunk: int = DEFAULT_CHUNK) -> float:
    """Forward FLOPs of one layer's core attention per token, all heads.

    Args:
        attention: ``"softmax"`` or a registered HLA operator (``"linear"``, ``"hla2"``...).
        seq_length: T (softmax's cost grows with it; HLA's does not).
        heads, kv_heads: query heads Hq and key/value heads Hkv (GQA: Hkv divides Hq).
        head_dim: K = V, the per-head width.
        chunk: C, the chunk length of HLA's chunked path.
    """
    for name, value in (("seq_length", seq_length), ("heads", heads), ("kv_heads", kv_heads),
                        ("head_dim", head_dim), ("chunk", chunk)):
        _check_pos(name, value)
    if heads % kv_heads:
        raise ValueError(f"kv_heads: expected a divisor of heads={heads}, got {kv_heads}")
    K = head_dim
    if attention == "softmax":
        return float(seq_length * (K + K) * heads)
    from hla_sp.ops.operators import get  # the operator table: which passes it makes

    total = 0
    for field in get(attention).fields:
        if len(field.dims) != 2:
            continue
        D = K  # "K" or "V": equal widths in the GPT layer
        owners = kv_heads if field.heads == "kv" else heads
        total += 2 * K * D * owners + (2 * K * D + chunk * (K + D)) * heads
    return float(total)


def gpt_flops_per_token(*, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int,
                        vocab: int, seq_length: int, attention: str, gated_mlp: bool = False,
                        chunk: int = DEFAULT_CHUNK) -> float:
    """Training FLOPs per token of a GPT (3x the forward): every layer's QKV, output
    projection and MLP (``gated_mlp``: SwiGLU's three matrices instead of two), its core
    attention (:func:`attention_flops_per_token`), and the output layer over ``vocab``
    (padded) ids. Embedding lookups and norms are not counted."""
    for name, value in (("layers", layers), ("hidden", hidden), ("ffn", ffn), ("vocab", vocab)):
        _check_pos(name, value)
    if hidden % heads:
        raise ValueError(f"heads: expected a divisor of hidden={hidden}, got {heads}")
    d = hidden // heads
    matmul = hidden * (hidden + 2 * kv_heads * d) + hidden * hidden \
        + (3 if gated_mlp else 2) * hidden * ffn
    core = attention_flops_per_token(attention, seq_length, heads, kv_heads, d, chunk)
    return 3.0 * (layers * (2 * matmul + core) + 2 * hidden * vocab)

"""The public function of the primitive: decayed causal linear attention (first order).

    LA(q, k, v)_t = sum_{j<=t} exp(A_t - A_j) (q_t . k_j) v_j
    h_t = exp(a_t) h_{t-1} + k_t v_t^T,   o_t = q_t^T h_t

The primitive itself, on validated inputs, is :mod:`hla_sp.ops.primitive`; this is its
documented public call, validated once by the runner as every operator is.
"""

from __future__ import annotations

import torch

from hla_sp.ops.primitive import DEFAULT_CHUNK_SIZE
from hla_sp.ops.runner import run_operator
from hla_sp.ops.sharding import BatchPlan
from hla_sp.ops.sp_protocol import SequenceParallelism


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    sp: SequenceParallelism | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    plan: BatchPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decayed causal linear attention (first order).

    Args:
        q: [B, T, H, K]. k: [B, T, Hkv, K]. v: [B, T, Hkv, V], with Hkv = H, or Hkv
            dividing H (GQA/MQA: query heads g * H/Hkv .. (g + 1) * H/Hkv - 1 read kv
            head g, whose state they share).
        log_decay: broadcasts to [B, T, Hkv], values <= 0; shape [Hkv] is a per-head
            constant.
        scale: multiplies q; default K ** -0.5.
        initial_state: [B, Hkv, K, V], or [N, Hkv, K, V] with cu_seqlens.
        output_final_state: also return the final state (same shape, fp32 or fp64).
        cu_seqlens: [N + 1] offsets of packed documents (B == 1).
        sp: a :class:`hla_sp.SequenceParallel`; each rank passes its shard.
        chunk_size: chunk length of the chunk-parallel path (a power of two; capped at
            the least power of two >= T, which gives the same result).
        plan: the batch's :class:`~hla_sp.ops.sharding.BatchPlan` instead of
            ``cu_seqlens`` (built once per batch: no host read here).

    Returns:
        (o [B, T, H, V] in q's dtype, final state or None)
    """
    o, state = run_operator(
        "linear", q, k, v, log_decay=log_decay, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, sp=sp,
        chunk_size=chunk_size, plan=plan)
    return o, None if state is None else state[0]

"""Second-order HLA on the fused Triton kernels (opt-in): autograd and public call.

:func:`hla2_fused` computes what :func:`hla_sp.hla2` computes, with k~ = S q kept on
chip (the kernels: :mod:`hla_sp.kernels.hla2_fused`, reached through
:mod:`hla_sp.ops.dispatch`). Validation, the state tuple, the normaliser and the
document resets are the composition's own helpers, so the two calls agree on every
keyword. Whether the fused form beats the composition is a GPU measurement
(benchmarks/gpu_check.sh times both); until then the default stays the composition.
"""

from __future__ import annotations

from typing import Any

import torch

from hla_sp.ops import validate
from hla_sp.ops.dispatch import (
    triton_fused_hla2_backward,
    triton_fused_hla2_forward,
    triton_fused_hla2_refusal,
    triton_unavailable_reason,
)
from hla_sp.ops.isolation import (
    bad_rows,
    bad_state,
    bad_tokens,
    cuts,
    either,
    poison_,
    poison_segments,
    poisoned_prefix,
)
from hla_sp.ops.primitive import DEFAULT_CHUNK_SIZE
from hla_sp.ops.stages import HLA2State, split_denominator, with_denominator
from hla_sp.ops.table import DEFAULT_EPS, state_fields

Tensor = torch.Tensor


def _like(grad: Tensor | None, x: Tensor | None) -> Tensor | None:
    """A gradient computed in fp32, in the dtype of the input it belongs to."""
    return None if grad is None or x is None else grad.to(x.dtype)


class FusedHLA2Function(torch.autograd.Function):
    """Autograd of the fused hla2; saves only the inputs (k~ is recomputed)."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, resets: Tensor | None,
        S0: Tensor | None, H0: Tensor | None, ridge: float, chunk_size: int, mode: str,
    ) -> tuple[Tensor, Tensor, Tensor]:
        o, S_T, H_T = triton_fused_hla2_forward(
            q, k, v, g, resets, S0, H0, ridge, chunk_size, mode
        )
        _poison_outputs(o, S_T, H_T, q, k, v, g, resets, S0, H0)
        ctx.save_for_backward(q, k, v, g, resets, S0, H0)
        ctx.ridge, ctx.chunk_size = ridge, chunk_size
        ctx.set_materialize_grads(False)
        return o, S_T, H_T

    @staticmethod
    def backward(
        ctx: Any, do: Tensor | None, dS_T: Tensor | None, dH_T: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        q, k, v, g, resets, S0, H0 = ctx.saved_tensors
        if do is None:
            do = q.new_zeros(*q.shape[:3], v.shape[-1])
        dq, dk, dv, dg, dS0, dH0 = triton_fused_hla2_backward(
            q, k, v, g, resets, S0, H0, ctx.ridge, do, dS_T, dH_T, ctx.chunk_size
        )
        # the kernels compute on clean operands: the poison goes back by flags
        bad = None
        if q.shape[1]:
            bad = bad_tokens(k, v, g) | bad_rows(q) | bad_rows(do)
        poison_segments([dq, dk, dv, dg], [dS0, dH0], bad, cuts(resets, g, k),
                        either(bad_state(S0), bad_state(H0)),
                        either(bad_state(dS_T), bad_state(dH_T)))
        return dq, dk, dv, _like(dg, g), None, _like(dS0, S0), _like(dH0, H0), None, None, None


def _poison_outputs(
    o: Tensor, S_T: Tensor, H_T: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None,
    resets: Tensor | None, S0: Tensor | None, H0: Tensor | None,
) -> None:
    """In place: NaN where the poison of non-finite inputs reaches (the kernels compute
    on clean operands, :mod:`hla_sp.ops.isolation`). Stage 1's keys and values are k;
    stage 2's key k~_t = S_t q_t is poisoned where stage 1's state is, or q_t is."""
    if q.shape[1] == 0:
        S_bad, H_bad = bad_state(S0), bad_state(H0)
        for x, flag in ((S_T, S_bad), (H_T, either(S_bad, H_bad))):
            if flag is not None:
                poison_(x, flag)
        return
    cut = cuts(resets, g, k)
    stage1 = poisoned_prefix(bad_tokens(k, k, g), cut, bad_state(S0))
    stage2 = poisoned_prefix(stage1 | bad_rows(q) | bad_rows(v), cut, bad_state(H0))
    poison_(o, stage2)
    poison_(S_T, stage1[:, -1])
    poison_(H_T, stage2[:, -1])


def fused_hla2_chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    *,
    resets: Tensor | None = None,
    S0: Tensor | None = None,
    H0: Tensor | None = None,
    ridge: float = 0.0,
    chunk_size: int = 64,
    mode: str = "chunked",
) -> tuple[Tensor, Tensor, Tensor]:
    """hla2 of already-scaled q, fused; the counterpart of the primitive's chunk function.

    Args:
        q: [B, T, H, K] scaled; k: [B, T, H, K]; v: [B, T, H, V] (fp32/fp16/bf16).
        g: [B, T, H] log-decay or None; resets: [B, T] bool or None.
        S0: [B, H, K, K], H0: [B, H, K, V] initial states or None.
        mode: "chunked" (chunk-parallel) or "sequential" (one program walks the chunks).

    Returns:
        o [B, T, H, V], S_T [B, H, K, K] and H_T [B, H, K, V], all fp32.
    """
    return FusedHLA2Function.apply(q, k, v, g, resets, S0, H0, float(ridge), chunk_size, mode)


def hla2_fused(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    log_decay: Tensor | None = None,
    normalize: bool = False,
    eps: float = DEFAULT_EPS,
    ridge: float = 0.0,
    scale: float | None = None,
    initial_state: HLA2State | tuple | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    mode: str = "chunked",
) -> tuple[Tensor, HLA2State | None]:
    """:func:`hla_sp.hla2` on the fused kernels (opt-in; single process, no ``sp``).

    Same keywords and results as ``hla_sp.hla2``. Packed documents (``cu_seqlens``)
    are supported without initial or final states (per-document states are the
    composition's job). Inputs must be on a device Triton runs on (CUDA, or CPU under
    ``TRITON_INTERPRET=1``). ``mode``: "chunked" or "sequential".

    Returns:
        (o [B, T, H, V] in q's dtype, HLA2State or None)
    """
    x = validate.check_inputs(
        q, k, v, log_decay=log_decay, scale=scale, cu_seqlens=cu_seqlens, sp=None,
        chunk_size=chunk_size,
    )
    if x.plan is not None and (initial_state is not None or output_final_state):
        raise NotImplementedError(
            "hla2_fused: cu_seqlens with initial_state or output_final_state; use hla_sp.hla2"
        )
    reason = triton_unavailable_reason(x.q.device, x.q.dtype)
    if reason is not None:
        raise RuntimeError(f"hla2_fused needs the Triton kernels, but {reason}")
    normalize = validate.check_bool("normalize", normalize)
    if mode == "sequential":  # refused before any work, from the ahead-of-time table
        refusal = triton_fused_hla2_refusal(  # normalize appends the denominator's column to v
            x.q.dtype, x.K, x.V + int(normalize), decay=x.g is not None,
            documents=x.plan is not None, states=initial_state is not None,
        )
        if refusal is not None:
            raise ValueError(refusal)
    fields = state_fields("hla2", x.n_seq, x.H, x.H, x.K, x.V, normalize)
    S0, H0, eta0 = validate.check_state_tuple(initial_state, fields, x.q)
    resets = None if x.plan is None else x.plan.resets(x.q.device)
    vv = x.v
    if normalize:
        vv, H0 = with_denominator(vv, H0, eta0)
    o, S_T, H_T = fused_hla2_chunk(
        x.q * x.scale, x.k, vv, x.g, resets=resets, S0=S0, H0=H0, ridge=ridge,
        chunk_size=x.chunk_size, mode=mode,
    )
    eta = None
    if normalize:
        o, H_T, eta = split_denominator(o, H_T, x.V, eps)
    state = HLA2State(S_T, H_T, eta) if output_final_state else None
    return o.to(x.q.dtype), state

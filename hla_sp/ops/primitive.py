"""The primitive: decayed causal linear attention on validated inputs.

    LA(q, k, v)_t = sum_{j<=t} exp(A_t - A_j) (q_t . k_j) v_j
    h_t = exp(a_t) h_{t-1} + k_t v_t^T,   o_t = q_t^T h_t

:func:`local_primitive` runs it on one process (packed documents, carries);
:func:`primitive` routes to sequence parallelism when ``sp`` is given. Every stage of
every operator is one call of :func:`primitive`; the operators' runner
(:mod:`hla_sp.ops.runner`) validates the public call once, above it.

Under it, the chunk scan as a ``torch.library`` custom operator
(:mod:`hla_sp.ops.chunk_op`), and the choice of the implementation that a call runs
(:func:`chunk_impl`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from hla_sp.ops.chunk import document_resets, segment_summary, with_carry_terms
from hla_sp.ops.chunk_op import (  # noqa: F401 (the operators, re-exported)
    chunk_linear_attention_bwd_op,
    chunk_linear_attention_op,
    scaled_query,
)
from hla_sp.ops.dispatch import backend_for
from hla_sp.ops.isolation import carry_into, finite_decay
from hla_sp.ops.one_token import needs_grad, one_token
from hla_sp.ops.sharding import BatchPlan
from hla_sp.ops.sp_protocol import SequenceParallelism

Tensor = torch.Tensor


def make_chunk_impl(backend: str) -> Callable[..., tuple[Tensor, Tensor]]:
    """A differentiable chunk scan that runs ``backend`` through the custom operator.

    The callable takes ``(q, k, v, g, *, resets=None, h0=None, chunk_size=64,
    scale=1.0)``: q [B, T, H, K] (times ``scale``, applied inside), k [B, T, H, K],
    v [B, T, H, V], g [B, T, H] log-decay (<= 0, -inf a hard reset) or None, resets
    [B, T] bool (True where a document starts; position 0 False) or None, h0
    [B, H, K, V] or None; it returns
    o [B, T, H, V] (the compute dtype on the torch backend, the inputs' on the Triton
    one) and the last state [B, H, K, V] in the compute dtype. One token
    without autograd (a decode step) runs the recurrence's step instead of the scan
    (:mod:`hla_sp.ops.one_token`)."""

    def impl(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor | None,
        *,
        resets: Tensor | None = None,
        h0: Tensor | None = None,
        chunk_size: int = 64,
        scale: float = 1.0,
    ) -> tuple[Tensor, Tensor]:
        if q.shape[1] == 1 and not needs_grad(q, k, v, g, h0):
            # a decode step: position 0 has no reset
            return one_token(scaled_query(q, scale), k, v, g, h0)
        o, h, _ = chunk_linear_attention_op(q, k, v, g, resets, h0, chunk_size, backend,
                                            float(scale))
        return o, h

    return impl


def chunk_linear_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    *,
    resets: Tensor | None = None,
    h0: Tensor | None = None,
    chunk_size: int = 64,
    scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Decayed causal linear attention on the Triton kernels, through the operator.

    Same signature and semantics as the callables of :func:`make_chunk_impl`.

    Args:
        q: [B, T, H, K], times ``scale`` in the kernels; k: [B, T, H, K]; v: [B, T, H, V]
            (fp32, fp16 or bf16, one dtype).
        g: [B, T, H] log-decay or None. resets: [B, T] bool or None.
        h0: [B, H, K, V] or None.
        chunk_size: requested chunk length; the kernels clamp it to [16, 64].

    Returns:
        o: [B, T, H, V] in the inputs' dtype (rounded once from the fp32 accumulator)
        and h_last: [B, H, K, V] fp32.
    """
    o, h, _ = chunk_linear_attention_op(q, k, v, g, resets, h0, chunk_size, "triton",
                                        float(scale))
    return o, h


ChunkImpl = Callable[..., tuple[Tensor, Tensor]]


def chunk_impl(x: Tensor) -> ChunkImpl:
    """The chunk-scan implementation for tensors like ``x`` (backend: :mod:`dispatch`)."""
    return make_chunk_impl(backend_for(x))

DEFAULT_CHUNK_SIZE = 64


def local_primitive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    *,
    bounds: tuple[int, ...] | None = None,
    resets: torch.Tensor | None = None,
    h0: torch.Tensor | None = None,
    want_final: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The primitive on one process, from validated inputs.

    Args:
        q: [B, T, H, K], to be multiplied by ``scale`` (by the kernels, on the fp32
            products of q: no pass of its own). k: [B, T, H, K]. v: [B, T, H, V].
        g: [B, T, H] log-decay or None.
        bounds: document offsets [N + 1] as Python ints (B == 1), or None.
        resets: their [1, T] resets when the batch's plan holds them already (built
            once per batch); None builds them from ``bounds``.
        h0: [N, H, K, V] initial state per sequence (N = B without documents), or None.
        want_final: also return the final state of each sequence.

    Returns:
        o: [B, T, H, V] in q's dtype; final: [N, H, K, V] (fp32, or fp64 for fp64
        inputs) or None.
    """
    impl = chunk_impl(q)
    if g is not None:
        # A per-head decay arrives broadcast ([H] -> [B, T, H], stride 0): laid out once
        # here, not by the kernels' forward and again by their backward.
        g = g.contiguous()
    if bounds is None:
        o, h_last = impl(q, k, v, g, h0=h0, chunk_size=chunk_size, scale=scale)
        return o.to(q.dtype), (h_last if want_final else None)
    if h0 is not None:
        # the carry terms below read the scaled q
        q, scale = scaled_query(q, scale), 1.0

    if resets is None:
        resets = document_resets(bounds, q.shape[1], q.device)
    # The first document's initial state is the carry into position 0; the others
    # are added to their documents afterwards (their starts cut the chunk carry).
    o, h_last = impl(
        q, k, v, g, resets=resets, h0=None if h0 is None else h0[:1], chunk_size=chunk_size,
        scale=scale,
    )
    docs = list(itertools.pairwise(bounds))

    def piece(x: torch.Tensor | None, s: int, e: int) -> torch.Tensor | None:
        return None if x is None else x[:, s:e]

    if h0 is not None:
        o = with_carry_terms(
            o, q, g, [(s, e, h0[i : i + 1]) for i, (s, e) in enumerate(docs[1:], start=1)])
    final = None
    if want_final:
        states = []
        for i, (s, e) in enumerate(docs[:-1]):
            h, a = segment_summary(k[:, s:e], v[:, s:e], piece(g, s, e))
            if h0 is not None:
                h = carry_into(h, a, h0[i : i + 1])
            states.append(h)
        if h0 is not None and len(docs) > 1:
            # The chunk scan saw the last document's start as a cut; add its carry.
            s = docs[-1][0]
            a = (
                finite_decay(g[:, s:].to(h_last.dtype)).sum(1)
                if g is not None
                else torch.zeros_like(h_last[..., 0, 0])
            )
            h_last = carry_into(h_last, a, h0[-1:])
        states.append(h_last)
        final = torch.cat(states, dim=0)
    return o.to(q.dtype), final


def primitive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    *,
    docs: BatchPlan | None = None,
    h0: torch.Tensor | None = None,
    want_final: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    sp: SequenceParallelism | None = None,
    call: Any = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`local_primitive`, or its sequence-parallel form when ``sp`` is given.

    ``docs``: the batch's plan (its documents), carried unchanged from the layer or the
    public call; on one process its resets, built once per batch, go to the kernel.
    Under ``sp`` each rank passes its shard; the plan's offsets and ``h0`` are global,
    and ``call`` is the call's plan, what ``sp.check_call`` returned for the operator
    call this stage belongs to (not the batch's plan, which the public functions take
    as ``plan=``). ``scale`` multiplies q: in the kernels on one process, before the
    exchange under ``sp``.
    """
    if sp is None:
        bounds = None if docs is None else docs.bounds
        return local_primitive(
            q, k, v, g, bounds=bounds, resets=None if bounds is None else docs.resets(q.device),
            h0=h0, want_final=want_final, chunk_size=chunk_size, scale=scale)
    q = scaled_query(q, scale)
    return sp.primitive(
        q, k, v, g, docs=docs, h0=h0, want_final=want_final, chunk_size=chunk_size, call=call,
    )

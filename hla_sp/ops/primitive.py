"""The primitive: decayed causal linear attention on validated inputs.

    LA(q, k, v)_t = sum_{j<=t} exp(A_t - A_j) (q_t . k_j) v_j
    h_t = exp(a_t) h_{t-1} + k_t v_t^T,   o_t = q_t^T h_t

:func:`local_primitive` runs it on one process (packed documents, carries);
:func:`primitive` routes to sequence parallelism when ``sp`` is given. Every stage of
every operator is one call of :func:`primitive`; the operators' runner
(:mod:`hla_sp.ops.runner`) validates the public call once, above it.

Under it, the chunk scan as a ``torch.library`` custom operator, and the choice of
the implementation that a call runs (:func:`chunk_impl`).

``torch.compile`` cannot trace into Triton launches (nor, with ``fullgraph=True``,
through the Python loops of the chunk path); an opaque operator with a fake (meta)
implementation and a registered backward is traced as one node. As in
flash-attention, both backends run through this operator in eager and compiled calls
alike: one path, one backward registration. The torch backend's forward keeps nothing
but its inputs and its backward recomputes the chunk summaries, the state scan and
the intra-chunk terms with hand-written gradients (:func:`hla_sp.ops.chunk.chunk_backward`),
so a training step holds no per-chunk activations.

Two operators, both taking the backend name chosen by :mod:`hla_sp.ops.dispatch`:

    hla_sp::chunk_linear_attention(q, k, v, g?, resets?, h0?, chunk_size, backend)
        -> (o [B, T, H G, V], h_last [B, H, K, V], bad [B, T, H] bool), q [B, T, H G, K]
        against k, v of H heads (G > 1: multi-query, query head h G + j reads kv head
        h's state, built once); h_last in the compute dtype (fp32, or fp64 for fp64
        inputs on the torch backend), o too on the torch backend and in the inputs'
        dtype on the Triton one (its kernels round it once, at the store), bad the
        tokens whose k, v or decay is non-finite (kept for the backward)
    hla_sp::chunk_linear_attention_bwd(q, k, v, g?, resets?, h0?, do, dht?, bad,
        chunk_size, backend) -> (dq, dk, dv, dg, dh0)

Absent gradients (no g, no h0) come back as empty tensors, because an operator's
outputs must be tensors; the autograd formula turns them back into None. The Triton
backend calls the backward kernels. Under ``torch.vmap`` both operators fold the vmapped
dimension into the batch (:mod:`hla_sp.ops.vmap_rules`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from hla_sp.ops.chunk import (
    chunk_backward,
    chunk_forward,
    document_resets,
    segment_summary,
    with_carry_terms,
)
from hla_sp.ops.dispatch import (
    backend_for,
    compute_dtype,
    triton_chunk_backward,
    triton_chunk_forward,
)
from hla_sp.ops.isolation import (
    backward_flags,
    bad_state,
    bad_tokens,
    carry_into,
    finite_decay,
    known_finite,
    poison_grads,
    poison_outputs,
)
from hla_sp.ops.one_token import needs_grad, one_token
from hla_sp.ops.sharding import BatchPlan
from hla_sp.ops.sp_protocol import SequenceParallelism

Tensor = torch.Tensor



def _out_dtype(q: Tensor, backend: str) -> torch.dtype:
    # The torch path keeps fp64 in fp64; the Triton path rejects fp64 (states are fp32).
    return torch.float32 if backend == "triton" else compute_dtype(q.dtype)


def _o_dtype(q: Tensor, backend: str) -> torch.dtype:
    # The Triton kernels store o in the inputs' dtype (rounded once, from fp32), so no
    # cast follows them; the torch path returns the compute dtype.
    return q.dtype if backend == "triton" else compute_dtype(q.dtype)


@torch.library.custom_op("hla_sp::chunk_linear_attention", mutates_args=())
def chunk_linear_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    resets: Tensor | None,
    h0: Tensor | None,
    chunk_size: int,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """The chunk scan of ``backend`` ("torch" or "triton"), in the compute dtype, and
    the bad-token flags.

    Both backends compute on clean operands; the poison of non-finite inputs is put
    back here, by flags (:mod:`hla_sp.ops.isolation`). The flags of k, v and g are an
    output so that the backward reads them instead of reducing k and v again."""
    bad = bad_tokens(k, v, g)
    G = _check_groups(q, k)
    if backend == "triton":
        o, h = triton_chunk_forward(q, k, v, g, resets, h0, chunk_size)
        clean = True
    else:
        # On the CPU, finite inputs skip the cleaning and the poisoning (identities then).
        clean = not known_finite(q, bad, bad_state(h0))
        # Contiguous and never an alias of h0, as the fake and the operator rules require.
        o, h = chunk_forward(q, k, v, g, resets, h0, chunk_size, clean=clean)
    if clean:
        poison_outputs(_by_kv_head(o, G), h, bad, g, resets, h0)
    return o, h, bad


def _check_groups(q: Tensor, k: Tensor) -> int:
    """G = Hq / Hkv of a multi-query call (q [B, T, Hq, K], k [B, T, Hkv, K])."""
    Hq, H = q.shape[2], k.shape[2]
    if H == 0 or Hq % H:
        raise ValueError(f"q: expected a multiple of k's {H} heads, got {Hq}")
    return Hq // H


def _by_kv_head(x: Tensor, G: int) -> Tensor:
    """[B, T, H G, D] -> [B, T, H, G D], the flags then per kv head: a view when x is
    contiguous, as the outputs and gradients that the poisoning writes in place are."""
    return x if G == 1 else x.reshape(*x.shape[:2], -1, G * x.shape[-1])


@chunk_linear_attention_op.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, resets: Tensor | None,
    h0: Tensor | None, chunk_size: int, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    B, T, Hq, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    o = q.new_empty(B, T, Hq, V, dtype=_o_dtype(q, backend))
    h = q.new_empty(B, H, K, V, dtype=_out_dtype(q, backend))
    return o, h, q.new_empty(B, T, H, dtype=torch.bool)


@torch.library.custom_op("hla_sp::chunk_linear_attention_bwd", mutates_args=())
def chunk_linear_attention_bwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    resets: Tensor | None,
    h0: Tensor | None,
    do: Tensor,
    dht: Tensor | None,
    bad: Tensor,
    chunk_size: int,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`chunk_linear_attention_op` (``bad``: its third output); dg,
    dh0 empty when g, h0 are None."""
    G = _check_groups(q, k)
    # per kv head: a group's shared state makes one segment of all its query heads
    flags = backward_flags(_by_kv_head(q, G), bad, _by_kv_head(do, G))
    if backend == "triton":
        dq, dk, dv, dg, dh0 = triton_chunk_backward(
            q, k, v, g, resets, h0, do, dht, chunk_size
        )
        clean = True
    else:
        clean = not known_finite(q, flags, bad_state(h0), bad_state(dht))
        dq, dk, dv, dg, dh0 = chunk_backward(q, k, v, g, resets, h0, do, dht, chunk_size,
                                             clean=clean)
    if clean:
        poison_grads([_by_kv_head(dq, G), dk, dv, dg], dh0, k, flags, g, resets, h0, dht)
    # Contiguous, in the inputs' dtypes: exactly what the fake below promises.
    # (Two distinct empties: outputs of an operator may not alias each other.)
    dg = q.new_empty(0) if dg is None else dg.to(g.dtype).contiguous()
    dh0 = q.new_empty(0) if dh0 is None else dh0.to(h0.dtype).contiguous()
    return (
        dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous(),
        dg, dh0,
    )


@chunk_linear_attention_bwd_op.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, resets: Tensor | None,
    h0: Tensor | None, do: Tensor, dht: Tensor | None, bad: Tensor, chunk_size: int,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    def like(x: Tensor) -> Tensor:
        return x.new_empty(x.shape)  # contiguous, whatever x's strides

    dg = q.new_empty(0) if g is None else like(g)
    dh0 = q.new_empty(0) if h0 is None else like(h0)
    return like(q), like(k), like(v), dg, dh0


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, g, resets, h0, chunk_size, backend = inputs
    ctx.save_for_backward(q, k, v, g, resets, h0, output[2])
    ctx.chunk_size, ctx.backend = chunk_size, backend
    ctx.has_g, ctx.has_h0 = g is not None, h0 is not None


def _backward(
    ctx: Any, do: Tensor | None, dht: Tensor | None, _dbad: Any
) -> tuple[Tensor | None, ...]:
    q, k, v, g, resets, h0, bad = ctx.saved_tensors
    if do is None:
        do = q.new_zeros(*q.shape[:3], v.shape[-1], dtype=_o_dtype(q, ctx.backend))
    dq, dk, dv, dg, dh0 = chunk_linear_attention_bwd_op(
        q, k, v, g, resets, h0, do, dht, bad, ctx.chunk_size, ctx.backend
    )
    return (
        dq, dk, dv, dg if ctx.has_g else None, None, dh0 if ctx.has_h0 else None, None, None,
    )


chunk_linear_attention_op.register_autograd(_backward, setup_context=_setup_context)



def make_chunk_impl(backend: str) -> Callable[..., tuple[Tensor, Tensor]]:
    """A differentiable chunk scan that runs ``backend`` through the custom operator.

    The callable takes ``(q, k, v, g, *, resets=None, h0=None, chunk_size=64)``:
    q [B, T, H, K] (already scaled), k [B, T, H, K], v [B, T, H, V], g [B, T, H]
    log-decay (<= 0, -inf a hard reset) or None, resets [B, T] bool (True where a
    document starts; position 0 False) or None, h0 [B, H, K, V] or None; it returns
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
    ) -> tuple[Tensor, Tensor]:
        if q.shape[1] == 1 and not needs_grad(q, k, v, g, h0):
            return one_token(q, k, v, g, h0)  # a decode step: position 0 has no reset
        o, h, _ = chunk_linear_attention_op(q, k, v, g, resets, h0, chunk_size, backend)
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
) -> tuple[Tensor, Tensor]:
    """Decayed causal linear attention on the Triton kernels, through the operator.

    Same signature and semantics as the callables of :func:`make_chunk_impl`.

    Args:
        q: [B, T, H, K], already scaled; k: [B, T, H, K]; v: [B, T, H, V]
            (fp32, fp16 or bf16, one dtype).
        g: [B, T, H] log-decay or None. resets: [B, T] bool or None.
        h0: [B, H, K, V] or None.
        chunk_size: requested chunk length; the kernels clamp it to [16, 64].

    Returns:
        o: [B, T, H, V] in the inputs' dtype (rounded once from the fp32 accumulator)
        and h_last: [B, H, K, V] fp32.
    """
    o, h, _ = chunk_linear_attention_op(q, k, v, g, resets, h0, chunk_size, "triton")
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The primitive on one process, from validated inputs.

    Args:
        q: [B, T, H, K], already scaled. k: [B, T, H, K]. v: [B, T, H, V].
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
    if bounds is None:
        o, h_last = impl(q, k, v, g, h0=h0, chunk_size=chunk_size)
        return o.to(q.dtype), (h_last if want_final else None)

    if resets is None:
        resets = document_resets(bounds, q.shape[1], q.device)
    # The first document's initial state is the carry into position 0; the others
    # are added to their documents afterwards (their starts cut the chunk carry).
    o, h_last = impl(
        q, k, v, g, resets=resets, h0=None if h0 is None else h0[:1], chunk_size=chunk_size
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`local_primitive`, or its sequence-parallel form when ``sp`` is given.

    ``docs``: the batch's plan (its documents), carried unchanged from the layer or the
    public call; on one process its resets, built once per batch, go to the kernel.
    Under ``sp`` each rank passes its shard; the plan's offsets and ``h0`` are global,
    and ``call`` is the call's plan, what ``sp.check_call`` returned for the operator
    call this stage belongs to (not the batch's plan, which the public functions take
    as ``plan=``).
    """
    if sp is None:
        bounds = None if docs is None else docs.bounds
        return local_primitive(
            q, k, v, g, bounds=bounds, resets=None if bounds is None else docs.resets(q.device),
            h0=h0, want_final=want_final, chunk_size=chunk_size)
    return sp.primitive(
        q, k, v, g, docs=docs, h0=h0, want_final=want_final, chunk_size=chunk_size, call=call,
    )

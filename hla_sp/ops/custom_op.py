"""The primitive's chunk scan as a ``torch.library`` custom operator, and the choice of
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
        -> (o [B, T, H, V], h_last [B, H, K, V], bad [B, T, H] bool); o and h_last in
        the compute dtype (fp32, or fp64 for fp64 inputs on the torch backend), bad
        the tokens whose k, v or decay is non-finite (kept for the backward)
    hla_sp::chunk_linear_attention_bwd(q, k, v, g?, resets?, h0?, do, dht?, bad,
        chunk_size, backend) -> (dq, dk, dv, dg, dh0)

Absent gradients (no g, no h0) come back as empty tensors, because an operator's
outputs must be tensors; the autograd formula turns them back into None. The Triton
backend calls the backward kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hla_sp.ops.chunk import chunk_backward, chunk_forward
from hla_sp.ops.dispatch import backend_for, triton_chunk_backward, triton_chunk_forward
from hla_sp.ops.isolation import (
    backward_flags,
    bad_state,
    bad_tokens,
    known_finite,
    poison_grads,
    poison_outputs,
)
from hla_sp.ops.one_token import needs_grad, one_token
from hla_sp.ops.precision import compute_dtype

Tensor = torch.Tensor


def _out_dtype(q: Tensor, backend: str) -> torch.dtype:
    # The torch path keeps fp64 in fp64; the Triton path rejects fp64 (states are fp32).
    return torch.float32 if backend == "triton" else compute_dtype(q.dtype)


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
    if backend == "triton":
        o, h = triton_chunk_forward(q, k, v, g, resets, h0, chunk_size)
        clean = True
    else:
        # On the CPU, finite inputs skip the cleaning and the poisoning (identities then).
        clean = not known_finite(q, bad, bad_state(h0))
        # Contiguous and never an alias of h0, as the fake and the operator rules require.
        o, h = chunk_forward(q, k, v, g, resets, h0, chunk_size, clean=clean)
    if clean:
        poison_outputs(o, h, bad, g, resets, h0)
    return o, h, bad


@chunk_linear_attention_op.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, resets: Tensor | None,
    h0: Tensor | None, chunk_size: int, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = q.new_empty(B, T, H, V, dtype=_out_dtype(q, backend))
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
    flags = backward_flags(q, bad, do)
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
        poison_grads([dq, dk, dv, dg], dh0, q, flags, g, resets, h0, dht)
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
        do = q.new_zeros(*q.shape[:3], v.shape[-1], dtype=_out_dtype(q, ctx.backend))
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
    o [B, T, H, V] and the last state [B, H, K, V] in the compute dtype. One token
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
        o: [B, T, H, V] and h_last: [B, H, K, V], both fp32 (the compute dtype, as the
        torch path returns them; the caller casts o).
    """
    o, h, _ = chunk_linear_attention_op(q, k, v, g, resets, h0, chunk_size, "triton")
    return o, h


ChunkImpl = Callable[..., tuple[Tensor, Tensor]]


def chunk_impl(x: Tensor) -> ChunkImpl:
    """The chunk-scan implementation for tensors like ``x`` (backend: :mod:`dispatch`)."""
    return make_chunk_impl(backend_for(x))

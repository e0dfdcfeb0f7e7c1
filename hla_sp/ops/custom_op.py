"""The primitive's chunk scan as a ``torch.library`` custom operator, and the choice of
the implementation that a call runs (:func:`chunk_impl`).

``torch.compile`` cannot trace into Triton launches (nor, with ``fullgraph=True``,
through the Python loops of the chunk path); an opaque operator with a fake (meta)
implementation and a registered backward is traced as one node. As in
flash-attention, the Triton backend runs through this operator in eager and compiled
calls alike: one path, one backward registration. The torch backend runs it while
compiling; eager torch calls use autograd of the chunk path itself, which keeps the
forward's activations, where the operator's backward recomputes the forward (1.6x
the time of a training step on CPU, measured at T = 4096, K = V = 64).

Two operators, both taking the backend name chosen by :mod:`hla_sp.ops.dispatch`:

    hla_sp::chunk_linear_attention(q, k, v, g?, resets?, h0?, chunk_size, backend)
        -> (o [B, T, H, V], h_last [B, H, K, V]), both in the compute dtype, as
        :func:`hla_sp.ops.chunk.chunk_linear_attention` returns them
    hla_sp::chunk_linear_attention_bwd(q, k, v, g?, resets?, h0?, do, dht?, chunk_size,
        backend) -> (dq, dk, dv, dg, dh0)

Absent gradients (no g, no h0) come back as empty tensors, because an operator's
outputs must be tensors; the autograd formula turns them back into None. The torch
backend's backward is the vjp of the torch chunk path, recomputed under
``enable_grad``: exactly autograd's gradient. The Triton backend calls the backward
kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hla_sp.ops.chunk import chunk_linear_attention, compute_dtype
from hla_sp.ops.dispatch import backend_for, triton_chunk_backward, triton_chunk_forward

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
) -> tuple[Tensor, Tensor]:
    """The chunk scan of ``backend`` ("torch" or "triton"), in the compute dtype."""
    if backend == "triton":
        return triton_chunk_forward(q, k, v, g, resets, h0, chunk_size)
    with torch.no_grad():
        o, h = chunk_linear_attention(q, k, v, g, resets=resets, h0=h0, chunk_size=chunk_size)
    # Contiguous, as the fake promises (the chunk path returns a permuted view); outputs
    # of a custom op may not alias its inputs: clone in the (T = 0) corner case.
    if h0 is not None and h.data_ptr() == h0.data_ptr():
        h = h.clone()
    return o.contiguous(), h.contiguous()


@chunk_linear_attention_op.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, resets: Tensor | None,
    h0: Tensor | None, chunk_size: int, backend: str,
) -> tuple[Tensor, Tensor]:
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = q.new_empty(B, T, H, V, dtype=_out_dtype(q, backend))
    h = q.new_empty(B, H, K, V, dtype=_out_dtype(q, backend))
    return o, h


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
    chunk_size: int,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`chunk_linear_attention_op`; dg, dh0 empty when g, h0 are None."""
    if backend == "triton":
        dq, dk, dv, dg, dh0 = triton_chunk_backward(
            q, k, v, g, resets, h0, do, dht, chunk_size
        )
    else:
        dq, dk, dv, dg, dh0 = _torch_vjp(q, k, v, g, resets, h0, do, dht, chunk_size)
    # Contiguous, in the inputs' dtypes: exactly what the fake below promises.
    # (Two distinct empties: outputs of an operator may not alias each other.)
    dg = q.new_empty(0) if dg is None else dg.to(g.dtype).contiguous()
    dh0 = q.new_empty(0) if dh0 is None else dh0.to(h0.dtype).contiguous()
    return (
        dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous(),
        dg, dh0,
    )


def _torch_vjp(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, resets: Tensor | None,
    h0: Tensor | None, do: Tensor, dht: Tensor | None, chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """The vjp of the torch chunk path, recomputed: exactly autograd's gradients.

    ``torch.func.vjp`` rather than ``torch.autograd.grad``: an operator's
    implementation runs below the autograd dispatch key, where ``enable_grad`` records
    nothing, while a function transform sets up its own autograd level.
    """

    def f(*xs: Tensor) -> tuple[Tensor, Tensor]:
        it = iter(xs[3:])
        gg = next(it) if g is not None else None
        hh = next(it) if h0 is not None else None
        o, h = chunk_linear_attention(*xs[:3], gg, resets=resets, h0=hh, chunk_size=chunk_size)
        return o, h

    primals = [q, k, v] + [x for x in (g, h0) if x is not None]
    (_, h), vjp_fn = torch.func.vjp(f, *primals)
    # o and h are both in the compute dtype
    grads = vjp_fn((do.to(h.dtype), torch.zeros_like(h) if dht is None else dht.to(h.dtype)))
    it = iter(grads[3:])
    dg = next(it) if g is not None else None
    dh0 = next(it) if h0 is not None else None
    return grads[0], grads[1], grads[2], dg, dh0


@chunk_linear_attention_bwd_op.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, resets: Tensor | None,
    h0: Tensor | None, do: Tensor, dht: Tensor | None, chunk_size: int, backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    def like(x: Tensor) -> Tensor:
        return x.new_empty(x.shape)  # contiguous, whatever x's strides

    dg = q.new_empty(0) if g is None else like(g)
    dh0 = q.new_empty(0) if h0 is None else like(h0)
    return like(q), like(k), like(v), dg, dh0


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, g, resets, h0, chunk_size, backend = inputs
    ctx.save_for_backward(q, k, v, g, resets, h0)
    ctx.chunk_size, ctx.backend = chunk_size, backend
    ctx.has_g, ctx.has_h0 = g is not None, h0 is not None


def _backward(ctx: Any, do: Tensor | None, dht: Tensor | None) -> tuple[Tensor | None, ...]:
    q, k, v, g, resets, h0 = ctx.saved_tensors
    if do is None:
        do = q.new_zeros(*q.shape[:3], v.shape[-1], dtype=_out_dtype(q, ctx.backend))
    dq, dk, dv, dg, dh0 = chunk_linear_attention_bwd_op(
        q, k, v, g, resets, h0, do, dht, ctx.chunk_size, ctx.backend
    )
    return (
        dq, dk, dv, dg if ctx.has_g else None, None, dh0 if ctx.has_h0 else None, None, None,
    )


chunk_linear_attention_op.register_autograd(_backward, setup_context=_setup_context)


def make_chunk_impl(backend: str) -> Callable[..., tuple[Tensor, Tensor]]:
    """A callable with the signature of :func:`hla_sp.ops.chunk.chunk_linear_attention`
    that runs ``backend`` through the custom operator."""

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
        return chunk_linear_attention_op(q, k, v, g, resets, h0, chunk_size, backend)

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

    Same signature and semantics as :func:`hla_sp.ops.chunk.chunk_linear_attention`.

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
    return chunk_linear_attention_op(q, k, v, g, resets, h0, chunk_size, "triton")


ChunkImpl = Callable[..., tuple[Tensor, Tensor]]


def chunk_impl(x: Tensor) -> ChunkImpl:
    """The chunk-scan implementation for tensors like ``x`` (backend: :mod:`dispatch`)."""
    name = backend_for(x)
    if name == "torch" and not torch.compiler.is_compiling():
        return chunk_linear_attention  # eager: autograd keeps the activations (see above)
    return make_chunk_impl(name)

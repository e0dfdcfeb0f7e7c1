"""The chunk scan as ``torch.library`` custom operators, both backends behind one
autograd registration.

``torch.compile`` cannot trace into Triton launches (nor, with ``fullgraph=True``,
through the Python loops of the chunk path); an opaque operator with a fake (meta)
implementation and a registered backward is traced as one node. As in
flash-attention, both backends run through this operator in eager and compiled calls
alike: one path, one backward registration. The torch backend's forward keeps nothing
but its inputs and its backward recomputes the chunk summaries, the state scan and
the intra-chunk terms with hand-written gradients (:func:`hla_sp.ops.chunk.chunk_backward`),
so a training step holds no per-chunk activations.

Two operators, both taking the backend name chosen by :mod:`hla_sp.ops.dispatch`:

    hla_sp::chunk_linear_attention(q, k, v, g?, resets?, h0?, chunk_size, backend, scale)
        -> (o [B, T, H G, V], h_last [B, H, K, V], bad), q [B, T, H G, K]
        against k, v of H heads (G > 1: multi-query, query head h G + j reads kv head
        h's state, built once); q is multiplied by ``scale`` inside (the kernels scale
        the fp32 products of q); h_last in the compute dtype (fp32, or fp64 for fp64 inputs on
        the torch backend), o too on the torch backend and in the inputs' dtype on the
        Triton one (its kernels round it once, at the store), bad the flags of the
        non-finite k, v, decay kept for the backward: [B, T, H] bool on the torch
        backend, the kernels' [B, T + 2, H] int32 on the Triton one (h0's too)
    hla_sp::chunk_linear_attention_bwd(q, k, v, g?, resets?, h0?, do, dht?, bad,
        chunk_size, backend, scale, v_is_k) -> (dq, dk, dv, dg, dh0), with ``v_is_k``
        (the forward's v was k itself) dk k's whole gradient and dv empty

Absent gradients (no g, no h0) come back as empty tensors, because an operator's
outputs must be tensors; the autograd formula turns them back into None. Under
``torch.vmap`` both operators fold the vmapped dimension into the batch
(:mod:`hla_sp.ops.vmap_rules`).
"""

from __future__ import annotations

from typing import Any

import torch

from hla_sp.ops.chunk import chunk_backward, chunk_forward
from hla_sp.ops.dispatch import compute_dtype, triton_chunk_backward, triton_chunk_forward
from hla_sp.ops.isolation import (
    backward_flags,
    bad_state,
    bad_tokens,
    known_finite,
    poison_grads,
    poison_outputs,
)

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
    scale: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """The chunk scan of ``backend`` ("torch" or "triton"), in the compute dtype, and
    the flags of its non-finite inputs.

    Both backends compute on clean operands and put the poison of non-finite inputs
    back by flags: the torch one here (:mod:`hla_sp.ops.isolation`), the Triton one in
    its kernels, which raise the flags from their own loads (:mod:`hla_sp.kernels._flags`).
    The flags are an output so that the backward reads them instead of reducing k and v
    again (:func:`_new_flags` says their layout)."""
    G = _check_groups(q, k)
    if backend == "triton":
        # The kernels raise the flags from their own loads and put the poison back in one
        # gated launch: finite inputs cost no pass of their own.
        return triton_chunk_forward(q, k, v, g, resets, h0, chunk_size, scale)
    q = scaled_query(q, scale)
    bad = bad_tokens(k, v, g)
    # On the CPU, finite inputs skip the cleaning and the poisoning (identities then).
    clean = not known_finite(q, bad, bad_state(h0))
    # Contiguous and never an alias of h0, as the fake and the operator rules require.
    o, h = chunk_forward(q, k, v, g, resets, h0, chunk_size, clean=clean)
    if clean:
        poison_outputs(_by_kv_head(o, G), h, bad, g, resets, h0)
    return o, h, bad


def scaled_query(q: Tensor, scale: float) -> Tensor:
    """q * scale on the torch backend (the kernels scale the fp32 products of q)."""
    return q if scale == 1.0 else q * scale


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
    h0: Tensor | None, chunk_size: int, backend: str, scale: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    B, T, Hq, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    o = q.new_empty(B, T, Hq, V, dtype=_o_dtype(q, backend))
    h = q.new_empty(B, H, K, V, dtype=_out_dtype(q, backend))
    return o, h, _new_flags(q, H, backend)


def _new_flags(q: Tensor, H: int, backend: str) -> Tensor:
    """The flags output, empty: the kernels' [B, T + 2, H] int32 on the Triton backend
    (:mod:`hla_sp.kernels._flags`), [B, T, H] bool bad tokens on the torch one."""
    B, T = q.shape[:2]
    if backend == "triton":
        return q.new_empty(B, T + 2, H, dtype=torch.int32)
    return q.new_empty(B, T, H, dtype=torch.bool)


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
    scale: float = 1.0,
    v_is_k: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`chunk_linear_attention_op` (``bad``: its third output); dg,
    dh0 empty when g, h0 are None; dq that of the unscaled q. With ``v_is_k`` (the
    forward's v was k) dk is k's whole gradient, summed in the kernels' epilogue, and
    dv is empty."""
    G = _check_groups(q, k)
    if backend == "triton":
        dq, dk, dv, dg, dh0 = triton_chunk_backward(
            q, k, v, g, resets, h0, do, dht, chunk_size, bad, scale, v_is_k
        )
    else:
        q = scaled_query(q, scale)
        # per kv head: a group's shared state makes one segment of all its query heads
        flags = backward_flags(_by_kv_head(q, G), bad, _by_kv_head(do, G))
        clean = not known_finite(q, flags, bad_state(h0), bad_state(dht))
        dq, dk, dv, dg, dh0 = chunk_backward(q, k, v, g, resets, h0, do, dht, chunk_size,
                                             clean=clean)
        if clean:
            poison_grads([_by_kv_head(dq, G), dk, dv, dg], dh0, k, flags, g, resets, h0,
                         dht)
        dq = scaled_query(dq, scale)
        if v_is_k:
            dk, dv = dk + dv, None
    # Contiguous, in the inputs' dtypes: exactly what the fake below promises.
    # (Distinct empties: outputs of an operator may not alias each other.)
    dg = q.new_empty(0) if dg is None else dg.to(g.dtype).contiguous()
    dh0 = q.new_empty(0) if dh0 is None else dh0.to(h0.dtype).contiguous()
    dv = q.new_empty(0) if dv is None else dv.to(v.dtype).contiguous()
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv, dg, dh0


@chunk_linear_attention_bwd_op.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, resets: Tensor | None,
    h0: Tensor | None, do: Tensor, dht: Tensor | None, bad: Tensor, chunk_size: int,
    backend: str, scale: float = 1.0, v_is_k: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    def like(x: Tensor) -> Tensor:
        return x.new_empty(x.shape)  # contiguous, whatever x's strides

    dg = q.new_empty(0) if g is None else like(g)
    dh0 = q.new_empty(0) if h0 is None else like(h0)
    return like(q), like(k), q.new_empty(0) if v_is_k else like(v), dg, dh0


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, g, resets, h0, chunk_size, backend, scale = inputs
    ctx.save_for_backward(q, k, v, g, resets, h0, output[2])
    ctx.chunk_size, ctx.backend, ctx.scale = chunk_size, backend, scale
    ctx.has_g, ctx.has_h0 = g is not None, h0 is not None
    # S = sum k k^T passes k as the value too: k's two gradients are then summed in the
    # kernels (no add pass). Identity is what eager calls keep; a traced call that loses
    # it gets two gradients that autograd adds, as before.
    ctx.v_is_k = k is v
    # An unused output gets None, not zeros: no fill launch, no dh_T read by the kernels.
    ctx.set_materialize_grads(False)


def _backward(
    ctx: Any, do: Tensor | None, dht: Tensor | None, _dbad: Any
) -> tuple[Tensor | None, ...]:
    q, k, v, g, resets, h0, bad = ctx.saved_tensors
    if do is None:
        do = q.new_zeros(*q.shape[:3], v.shape[-1], dtype=_o_dtype(q, ctx.backend))
    dq, dk, dv, dg, dh0 = chunk_linear_attention_bwd_op(
        q, k, v, g, resets, h0, do, dht, bad, ctx.chunk_size, ctx.backend, ctx.scale,
        ctx.v_is_k,
    )
    return (
        dq, dk, None if ctx.v_is_k else dv, dg if ctx.has_g else None, None,
        dh0 if ctx.has_h0 else None, None, None, None,
    )


chunk_linear_attention_op.register_autograd(_backward, setup_context=_setup_context)

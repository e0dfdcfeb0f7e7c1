"""The chunk algebra of one block: the state scan over its chunks and the gradient terms.

Shared by the one-call path (:mod:`hla_sp.ops.chunk.scan`) and the path split around
a late carry-in state (:mod:`hla_sp.ops.chunk_split`). Every function takes a block
already cut into chunks (:class:`hla_sp.ops.chunk.layout.Chunks`); ``do_chunks`` is
the outputs' cotangent dO cut as the query rows, [B, H, N, C G, V] (G = 1 but for
multi-query, where a state is read by G query rows per token and its gradient sums
them: the matmuls over the rows do that sum).
"""

from __future__ import annotations

import torch

from hla_sp.ops.chunk.layout import Chunks, per_token, weighted

Tensor = torch.Tensor


def addmm(acc: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """acc += a @ b in place, batched over all leading dims ([..., M, N] += [..., M, L] @
    [..., L, N]): one fused baddbmm, no temporary the size of acc."""
    flat = acc.view(-1, *acc.shape[-2:])
    flat.baddbmm_(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
    return acc


def incoming_states(ch: Chunks, h0: Tensor | None) -> tuple[Tensor, Tensor]:
    """The state entering each chunk, h_in [B, H, N, K, V], and the last state [B, H, K, V].

    All chunk summaries in one batched matmul, then the scan h_n = p_n h_{n-1} + s_n
    over N, in place (one fused multiply-add per chunk on a [B, H, K, V] state).
    """
    s = weighted(ch.kc, ch.ws).transpose(-1, -2) @ ch.vc  # [B, H, N, K, V]
    if h0 is not None:
        s[:, :, 0].addcmul_(ch.p[:, :, 0, None, None], h0.to(s.dtype))
    for n in range(1, s.shape[2]):
        s[:, :, n].addcmul_(ch.p[:, :, n, None, None], s[:, :, n - 1])
    first = torch.zeros_like(s[:, :, :1]) if h0 is None else h0.to(s.dtype)[:, :, None]
    return torch.cat([first, s[:, :, :-1]], dim=2), s[:, :, -1]


def reverse_states(ch: Chunks, do_chunks: Tensor, dh_next: Tensor | None) -> Tensor:
    """dH_in [B, H, N, K, V], the gradient of the state entering each chunk, from the
    outputs' cotangent ``do_chunks`` [B, H, N, C, V] and dh_next [B, H, K, V] (the
    gradient of the state leaving the block, or None for 0), in place:
    X_n = (Q ⊙ wc)_n^T dO_n, then X_n += p_n X_{n+1}."""
    dh_in = weighted(ch.qc, ch.wc).transpose(-1, -2) @ do_chunks
    if dh_next is not None:
        dh_in[:, :, -1].addcmul_(ch.p[:, :, -1, None, None], dh_next)
    for n in range(dh_in.shape[2] - 2, -1, -1):
        dh_in[:, :, n].addcmul_(ch.p[:, :, n, None, None], dh_in[:, :, n + 1])
    return dh_in


def local_grads(
    ch: Chunks, h_in: Tensor, do_chunks: Tensor, want_dg: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The part of one block's gradients that needs only the outputs' cotangent
    ``do_chunks`` [B, H, N, C, V] and the incoming states h_in [B, H, N, K, V]: dQ whole,
    the in-chunk parts of dK, dV and of dg (on the segment sums and the carry weight).

    Returns dq [B, H, N, C G, K], dk [B, H, N, C, K], dv [B, H, N, C, V] and dg
    [B, H, N, C] (None without ``want_dg``)."""
    dA = do_chunks @ ch.vc.transpose(-1, -2)  # [B, H, N, C, C]
    A = (ch.qc @ ch.kc.transpose(-1, -2)).mul_(ch.D)
    dv = A.transpose(-1, -2) @ do_chunks
    dq_carry = do_chunks @ h_in.transpose(-1, -2)  # [B, H, N, C, K]
    dg = None
    if want_dg:
        dL = dA * A  # gradient of each in-chunk segment sum; 0 where masked
        # on b_t as the later end (the token's G query rows), minus as the earlier
        db = per_token(dL.sum(-1), ch.G) - dL.sum(-2)
        del dL
        db += per_token((weighted(ch.qc, ch.wc) * dq_carry).sum(-1), ch.G)  # exp(b_t)
        dg = segment_suffix_sums(db, ch.seg)  # g_i enters b_t for every t >= i
    del A
    dQK = dA.mul_(ch.D)
    if ch.wc is not None:
        dq_carry.mul_(ch.wc[..., None])
    dq = addmm(dq_carry, dQK, ch.kc)
    dk = dQK.transpose(-1, -2) @ ch.qc
    return dq, dk, dv, dg


def segment_suffix_sums(x: Tensor, seg: Tensor | None) -> Tensor:
    """out[..., i] = sum of x[..., t] over t >= i in i's segment, per chunk ([..., C];
    ``seg`` as :attr:`Chunks.seg`, None when there are no cuts).

    Across a cut the terms of a later segment sum to zero, but only up to rounding,
    and would carry that segment's values (or a NaN) into the earlier one's gradient:
    with cuts they are left out by a select, not cancelled."""
    if seg is None:
        return x.flip(-1).cumsum(-1).flip(-1)
    C = x.shape[-1]
    later = torch.ones(C, C, dtype=torch.bool, device=x.device).triu()  # [i, t]: t >= i
    keep = later & (seg[..., :, None] == seg[..., None, :])
    return torch.where(keep, x[..., None, :], 0.0).sum(-1)


def state_grads(
    ch: Chunks, h_in: Tensor, dh_out: Tensor, dk: Tensor, dv: Tensor, dg: Tensor | None
) -> None:
    """Add, in place, the part of one block's gradients that flows through the states
    leaving its chunks, dh_out [B, H, N, K, V]: the summaries' dK, dV, and on dg the
    summary weights exp(b_C - b_j) and the pass factors p <h_in, dh_out>."""
    kw = weighted(ch.kc, ch.ws)
    dk_state = ch.vc @ dh_out.transpose(-1, -2)  # [B, H, N, C, K]
    addmm(dv, kw, dh_out)
    if dg is not None:
        dlws = (kw * dk_state).sum(-1)
        dg += dlws.cumsum(-1) - dlws  # g_i enters b_C - b_j for every j < i ...
        dg += (ch.p * (h_in * dh_out).sum((-1, -2)))[..., None]  # ... and b_C
    if ch.ws is None:
        dk.add_(dk_state)
    else:
        dk.addcmul_(dk_state, ch.ws[..., None])


def block_backward(
    ch: Chunks, h_entry: Tensor, do_chunks: Tensor, dh_next: Tensor, want_dg: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """Gradients of one block of chunks (see :func:`hla_sp.ops.chunk.chunk_backward`).

    Args:
        ch: the block's chunks; h_entry: [B, H, K, V] the state entering the block.
        do_chunks: [B, H, N, C, V] the outputs' cotangent; dh_next: [B, H, K, V] the
            gradient of the state leaving the block.

    Returns dq [B, H, N, C G, K], dk [B, H, N, C, K], dv [B, H, N, C, V], dg
    [B, H, N, C] or None, and the gradient of the state entering the block.
    """
    h_in, _ = incoming_states(ch, h_entry)
    dh_in = reverse_states(ch, do_chunks, dh_next)
    dh_out = torch.cat([dh_in[:, :, 1:], dh_next[:, :, None]], dim=2)  # each chunk's end
    dq, dk, dv, dg = local_grads(ch, h_in, do_chunks, want_dg)
    state_grads(ch, h_in, dh_out, dk, dv, dg)
    return dq, dk, dv, dg, dh_in[:, :, 0]

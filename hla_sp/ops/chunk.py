"""The chunk-parallel PyTorch path of the primitive, decayed causal linear attention.

Inside a chunk of C tokens the work is masked matmuls; between chunks a state of
size K x V is passed on. This is the algebra of the segment summaries (docs/math.md
section 4) with chunks in place of ranks:

    summary of chunk n:   s_n = sum_j exp(b_C - b_j) k_j v_j^T,  pass factor p_n = exp(b_C)
    state after chunk n:  h_n = p_n h_{n-1} + s_n
    output:               o_t = sum_{j<=t in chunk} exp(b_t - b_j)(q_t.k_j) v_j
                              + exp(b_t) q_t h_{n-1}

with b the within-chunk cumulative log-decay. Every in-chunk weight is the exp of a
*segment sum* (a masked cumulative sum of the log-decays between two tokens, as
Mamba-2's ``segsum``), never a difference of two prefix sums: b_t - b_j cancels
catastrophically once one token's decay is huge (-1e6 costs all of fp32's digits,
-1e30 all of fp64's) and is NaN for a hard reset (-inf - -inf). A segment sum has
no cancellation, and -inf simply gives a weight of 0.

Memory: the forward keeps nothing but its inputs (autograd saves q, k, v, g, h0); the
backward recomputes the chunk summaries (one batched matmul), the state scan and the
intra-chunk terms, and applies hand-written gradients. All chunks are handled by
batched matmuls over [B, H, N, C, .]; only the state passing between chunks is a
loop over N, on [B, H, K, V] states, in place. Cost O(T C (K + V) + T K V) time and
O(T (C + K + V)) transient memory.

Document starts (``resets``) cut the carry, which is the summary's "contains a
start" flag: pairs across a start are masked, and a chunk containing a start passes
on only the part after its last start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hla_sp.ops.isolation import (
    bad_state,
    bad_tokens,
    cuts,
    finite,
    finite_decay,
    poison_grads,
    poison_outputs,
    poisoned_prefix,
)
from hla_sp.ops.precision import compute_dtype

Tensor = torch.Tensor


def document_resets(bounds: Sequence[int], T: int, device: torch.device) -> torch.Tensor:
    """[1, T] bool ``resets``: True at every document start but the first.

    Args:
        bounds: the document offsets as Python ints, [N + 1] (cu_seqlens.tolist()).
    """
    resets = torch.zeros(1, T, dtype=torch.bool, device=device)
    resets[0, list(bounds[1:-1])] = True
    return resets


def segsum(g: Tensor) -> Tensor:
    """Stable in-chunk segment sums: out[..., t, j] = sum_{j < i <= t} g[..., i] for
    j <= t, -inf above the diagonal.

    Args:
        g: [..., C] log-decays of one chunk (<= 0; -inf allowed).

    Returns:
        [..., C, C]. A masked cumulative sum: no difference of prefix sums, so a huge
        decay at one token cannot swamp the others, and -inf never meets -inf.
    """
    C = g.shape[-1]
    x = g[..., :, None].expand(*g.shape, C)  # x[..., i, j] = g_i
    strict = torch.ones(C, C, dtype=torch.bool, device=g.device).tril(-1)
    out = x.masked_fill(~strict, 0.0).cumsum(-2)  # the diagonal sums nothing: 0
    return out.masked_fill(~torch.ones_like(strict).tril(), float("-inf"))


@dataclass
class _Chunks:
    """Inputs cut into chunks, heads first, and the decay weights of every chunk.

    qc, kc: [B, H, N, C, K]; vc: [B, H, N, C, V] (compute dtype, zero-padded).
    D: [B, H, N, C, C] in-chunk decay exp(segsum), 0 where masked (causal, resets).
    wc: [B, H, N, C] weight of the incoming state for token t, exp(b_t).
    ws: [B, H, N, C] weight of token j in its chunk's summary, exp(b_C - b_j).
        wc and ws are None when they are all ones (no decay, no document start).
    p: [B, H, N] pass factor of each chunk, exp(b_C) (0 when the chunk holds a start).
    seg: [B, H, N, C] (or [B, 1, N, C]) the segment of each token inside its chunk, the
        number of cuts (document starts, log-decays of -inf) up to it; None when there
        can be none (no decay, no document start).
    """

    qc: Tensor  # any of qc, kc, vc is None when prepared without it
    kc: Tensor
    vc: Tensor
    D: Tensor | None  # None when prepared without the in-chunk terms
    wc: Tensor | None
    ws: Tensor | None
    p: Tensor
    T: int
    pad: int
    seg: Tensor | None = None


def _weighted(x: Tensor, w: Tensor | None) -> Tensor:
    """x [..., C, D] times a per-token weight w [..., C]; w None (all ones) costs no copy."""
    return x if w is None else x * w[..., None]


def _heads_first(x: Tensor, B: int, N: int, C: int, H: int) -> Tensor:
    """[B, N C, H, D] -> [B, H, N, C, D], contiguous: batched matmuls on a permuted view
    copy per batch and run several times slower (measured 10x for [1, 4, 256, 64, 64])."""
    return x.reshape(B, N, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4).contiguous()


def _prepare(
    q: Tensor | None, k: Tensor | None, v: Tensor | None, g: Tensor | None,
    resets: Tensor | None, C: int, intra: bool = True, clean_q: bool = True,
) -> _Chunks:
    """Cut a block into chunks; ``intra=False`` skips D (the [C, C] in-chunk decays,
    the costly part), for passes that only touch the states, and a None among q, k, v
    skips that tensor's heads-first copy (its field is then None).

    The copies are clean (:mod:`hla_sp.ops.isolation`): non-finite entries are 0, and
    a NaN or +inf log-decay is 0; the callers put the poison back by flags. A forward
    may pass ``clean_q=False``: a non-finite q_t only reaches o_t, which it should."""
    ref = next(x for x in (q, k, v) if x is not None)
    B, T, H, _ = ref.shape
    N = -(-T // C)
    pad = N * C - T
    cdt = compute_dtype(ref.dtype)

    def cut(x: Tensor | None, clean: bool = True) -> Tensor | None:
        if x is None:
            return None
        y = x.to(cdt)
        if pad:
            # Padding at the end with q = k = v = 0 and g = 0 leaves the state unchanged.
            y = F.pad(y, (0, 0, 0, 0, 0, pad))
        y = _heads_first(y, B, N, C, H)
        # a zero weight must mean nothing, and a matmul gives 0 * NaN = NaN: clean the
        # operands (in place on the copy just made)
        return finite(y, x) if clean else y

    qc, kc, vc = cut(q, clean_q), cut(k), cut(v)
    q = ref.to(cdt)  # for the factories below
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    D: Tensor | None = None
    seg: Tensor | None = None
    if g is None:
        if intra:
            D = causal.to(cdt).expand(B, H, N, C, C)
        wc = ws = None  # all ones: no per-token weight to apply
        p = q.new_ones(B, H, N)
    else:
        gg = F.pad(g.to(cdt), (0, 0, 0, pad)) if pad else g.to(cdt)
        gc = finite_decay(gg.reshape(B, N, C, H).permute(0, 3, 1, 2))  # [B, H, N, C]
        if intra:
            D = torch.exp(segsum(gc))  # [B, H, N, C, C]
        wc = torch.exp(gc.cumsum(-1))  # a prefix sum from the chunk start: no cancellation
        # exp(sum_{i > j} g_i), a suffix sum from the chunk end: no cancellation either
        ws = torch.exp(F.pad(gc[..., 1:].flip(-1).cumsum(-1).flip(-1), (0, 1)))
        p = wc[..., -1]
        seg = (gc == float("-inf")).cumsum(-1)  # hard resets
    if resets is not None:
        r = resets.to(torch.bool)
        if pad:
            r = F.pad(r, (0, pad))
        c = r.view(B, N, C).long().cumsum(-1)[:, None]  # starts seen so far in the chunk
        seg = c if seg is None else seg + c
        # selects, not products: a masked weight is 0 whatever it would have been
        if D is not None:
            keep = causal & (c[..., :, None] == c[..., None, :])  # [B, 1, N, C, C]
            D = D.masked_fill_(~keep, 0.0) if g is not None else keep.to(cdt).expand_as(D)
        ones = q.new_ones(B, H, N, C)
        ws = torch.where(c == c[..., -1:], ones if ws is None else ws, 0.0)
        wc = torch.where(c == 0, ones if wc is None else wc, 0.0)
        p = torch.where(c[..., -1] == 0, p, 0.0)
    return _Chunks(qc, kc, vc, D, wc, ws, p, T, pad, seg)


def _addmm(acc: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """acc += a @ b in place, batched over all leading dims ([..., M, N] += [..., M, L] @
    [..., L, N]): one fused baddbmm, no temporary the size of acc."""
    flat = acc.view(-1, *acc.shape[-2:])
    flat.baddbmm_(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
    return acc


def _incoming_states(ch: _Chunks, h0: Tensor | None) -> tuple[Tensor, Tensor]:
    """The state entering each chunk, h_in [B, H, N, K, V], and the last state [B, H, K, V].

    All chunk summaries in one batched matmul, then the scan h_n = p_n h_{n-1} + s_n
    over N, in place (one fused multiply-add per chunk on a [B, H, K, V] state).
    """
    s = _weighted(ch.kc, ch.ws).transpose(-1, -2) @ ch.vc  # [B, H, N, K, V]
    if h0 is not None:
        s[:, :, 0].addcmul_(ch.p[:, :, 0, None, None], h0.to(s.dtype))
    for n in range(1, s.shape[2]):
        s[:, :, n].addcmul_(ch.p[:, :, n, None, None], s[:, :, n - 1])
    first = torch.zeros_like(s[:, :, :1]) if h0 is None else h0.to(s.dtype)[:, :, None]
    return torch.cat([first, s[:, :, :-1]], dim=2), s[:, :, -1]


def _to_tokens(x: Tensor, T: int) -> Tensor:
    """[B, H, N, C, D] -> [B, T, H, D] (drops the padding)."""
    B, H, N, C, Dd = x.shape
    return x.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, Dd)[:, :T]


def _tokens_of_chunk_values(x: Tensor, T: int) -> Tensor:
    """[B, H, N, C] -> [B, T, H] (drops the padding)."""
    B, H, N, C = x.shape
    return x.permute(0, 2, 3, 1).reshape(B, N * C, H)[:, :T]


BLOCK_TOKENS = 512
"""Tokens per block of the blocked forward and backward, at a width B H (K + V) of
BLOCK_WIDTH: every temporary is the size of one block (8 chunks of 64), so the memory a
call adds beyond its inputs and outputs does not grow with T, while each batched matmul
still covers 8 x B x H chunks. Measured for hla2 at T = 16k, B=1, H=4, K=V=64, 1 thread:
512 tokens 155 MiB and 0.40 s fwd+bwd, 1024 tokens 185 MiB and 0.41 s, 2048 tokens
203 MiB and 0.52 s."""

BLOCK_WIDTH = 512
"""A narrower call gets proportionally longer blocks (up to 16x), so that a block holds
about as many elements: at small widths the per-operation overhead of many small
blocks dominates. Measured for hla2 at T = 8k, B=1, H=2, K=V=32 (width 128), 1 thread:
512-token blocks 91 ms fwd+bwd, 2048-token blocks 77 ms."""


def _blocks(T: int, C: int, width: int) -> list[tuple[int, int]]:
    """Token ranges [t0, t1) of the blocks: whole chunks, the last one possibly short.
    ``width`` is B H (K + V) of the call."""
    scale = min(16, max(1, BLOCK_WIDTH // max(1, width)))
    step = max(1, BLOCK_TOKENS * scale // C) * C
    return [(t0, min(T, t0 + step)) for t0 in range(0, T, step)]


def _part(x: Tensor | None, t0: int, t1: int) -> Tensor | None:
    return None if x is None else x[:, t0:t1]


def chunk_forward(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, resets: Tensor | None,
    h0: Tensor | None, chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """The forward of :func:`chunk_linear_attention`, without autograd, block by block.

    Returns o [B, T, H, V] (contiguous) and h_last [B, H, K, V], in the compute dtype.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    cdt = compute_dtype(q.dtype)
    # clean, and never an alias of h0 (the caller puts a non-finite h0's poison back)
    h = torch.zeros(B, H, K, V, dtype=cdt, device=q.device) if h0 is None else finite(h0.to(cdt))
    if T == 0:  # an empty shard: no outputs, and the carry passes through unchanged
        return q.new_zeros(B, 0, H, V, dtype=cdt), h
    o = q.new_empty(B, T, H, V, dtype=cdt)
    with torch.no_grad():
        for t0, t1 in _blocks(T, chunk_size, B * H * (K + V)):
            ch = _prepare(q[:, t0:t1], k[:, t0:t1], v[:, t0:t1], _part(g, t0, t1),
                          _part(resets, t0, t1), chunk_size, clean_q=False)
            h_in, h = _incoming_states(ch, h)
            attn = (ch.qc @ ch.kc.transpose(-1, -2)).mul_(ch.D)  # [B, H, N, C, C]
            ob = _addmm(attn @ ch.vc, _weighted(ch.qc, ch.wc), h_in)
            del attn
            o[:, t0:t1] = _to_tokens(ob, t1 - t0)
    return o, h.contiguous()


def _reverse_states(ch: _Chunks, doc: Tensor, dh_next: Tensor | None) -> Tensor:
    """dH_in [B, H, N, K, V], the gradient of the state entering each chunk, from the
    outputs' cotangent doc [B, H, N, C, V] and dh_next [B, H, K, V] (the gradient of the
    state leaving the block, or None for 0), in place: X_n = (Q ⊙ wc)_n^T dO_n, then
    X_n += p_n X_{n+1}."""
    dh_in = _weighted(ch.qc, ch.wc).transpose(-1, -2) @ doc
    if dh_next is not None:
        dh_in[:, :, -1].addcmul_(ch.p[:, :, -1, None, None], dh_next)
    for n in range(dh_in.shape[2] - 2, -1, -1):
        dh_in[:, :, n].addcmul_(ch.p[:, :, n, None, None], dh_in[:, :, n + 1])
    return dh_in


def _local_grads(
    ch: _Chunks, h_in: Tensor, doc: Tensor, want_dg: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The part of one block's gradients that needs only the outputs' cotangent doc
    [B, H, N, C, V] and the incoming states h_in [B, H, N, K, V]: dQ whole, the in-chunk
    parts of dK, dV and of dg (on the segment sums and the carry weight)."""
    dA = doc @ ch.vc.transpose(-1, -2)  # [B, H, N, C, C]
    A = (ch.qc @ ch.kc.transpose(-1, -2)).mul_(ch.D)
    dv = A.transpose(-1, -2) @ doc
    dq_carry = doc @ h_in.transpose(-1, -2)  # [B, H, N, C, K]
    dg = None
    if want_dg:
        dL = dA * A  # gradient of each in-chunk segment sum; 0 where masked
        db = dL.sum(-1) - dL.sum(-2)  # on b_t as the later end, minus as the earlier
        del dL
        db += (_weighted(ch.qc, ch.wc) * dq_carry).sum(-1)  # the carry weight exp(b_t)
        dg = _segment_suffix_sums(db, ch.seg)  # g_i enters b_t for every t >= i
    del A
    dQK = dA.mul_(ch.D)
    if ch.wc is not None:
        dq_carry.mul_(ch.wc[..., None])
    dq = _addmm(dq_carry, dQK, ch.kc)
    dk = dQK.transpose(-1, -2) @ ch.qc
    return dq, dk, dv, dg


def _segment_suffix_sums(x: Tensor, seg: Tensor | None) -> Tensor:
    """out[..., i] = sum of x[..., t] over t >= i in i's segment, per chunk ([..., C]).

    Across a cut the terms of a later segment sum to zero, but only up to rounding,
    and would carry that segment's values (or a NaN) into the earlier one's gradient:
    with cuts they are left out by a select, not cancelled."""
    if seg is None:
        return x.flip(-1).cumsum(-1).flip(-1)
    C = x.shape[-1]
    later = torch.ones(C, C, dtype=torch.bool, device=x.device).triu()  # [i, t]: t >= i
    keep = later & (seg[..., :, None] == seg[..., None, :])
    return torch.where(keep, x[..., None, :], 0.0).sum(-1)


def _state_grads(
    ch: _Chunks, h_in: Tensor, dh_out: Tensor, dk: Tensor, dv: Tensor, dg: Tensor | None
) -> None:
    """Add, in place, the part of one block's gradients that flows through the states
    leaving its chunks, dh_out [B, H, N, K, V]: the summaries' dK, dV, and on dg the
    summary weights exp(b_C - b_j) and the pass factors p <h_in, dh_out>."""
    kw = _weighted(ch.kc, ch.ws)
    dk_state = ch.vc @ dh_out.transpose(-1, -2)  # [B, H, N, C, K]
    _addmm(dv, kw, dh_out)
    if dg is not None:
        dlws = (kw * dk_state).sum(-1)
        dg += dlws.cumsum(-1) - dlws  # g_i enters b_C - b_j for every j < i ...
        dg += (ch.p * (h_in * dh_out).sum((-1, -2)))[..., None]  # ... and b_C
    if ch.ws is None:
        dk.add_(dk_state)
    else:
        dk.addcmul_(dk_state, ch.ws[..., None])


def _block_backward(
    ch: _Chunks, h_entry: Tensor, doc: Tensor, dh_next: Tensor, want_dg: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """Gradients of one block of chunks (see :func:`chunk_backward`).

    Args:
        ch: the block's chunks; h_entry: [B, H, K, V] the state entering the block.
        doc: [B, H, N, C, V] the outputs' cotangent; dh_next: [B, H, K, V] the gradient
            of the state leaving the block.

    Returns dq, dk [B, H, N, C, K], dv [B, H, N, C, V], dg [B, H, N, C] or None, and
    the gradient of the state entering the block.
    """
    h_in, _ = _incoming_states(ch, h_entry)
    dh_in = _reverse_states(ch, doc, dh_next)
    dh_out = torch.cat([dh_in[:, :, 1:], dh_next[:, :, None]], dim=2)  # each chunk's end
    dq, dk, dv, dg = _local_grads(ch, h_in, doc, want_dg)
    _state_grads(ch, h_in, dh_out, dk, dv, dg)
    return dq, dk, dv, dg, dh_in[:, :, 0]


def chunk_backward(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, resets: Tensor | None,
    h0: Tensor | None, do: Tensor, dht: Tensor | None, chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Gradients of :func:`chunk_forward` from its inputs alone (everything recomputed).

    With the cotangents do [B, T, H, V] and dht [B, H, K, V] (or None), per chunk, with
    A = (Q K^T) ⊙ D, dA = dO V^T and dH the gradient of the state after the chunk:

        dH_in = p dH + (Q ⊙ wc)^T dO      (a reverse scan over the chunks)
        dQ = (dA ⊙ D) K + (dO H_in^T) ⊙ wc
        dK = (dA ⊙ D)^T Q + (V dH^T) ⊙ ws
        dV = A^T dO + (K ⊙ ws) dH

    and the decay's gradient through the log-weights: dA ⊙ A on each (t, j) segment
    sum (g_i for j < i <= t), the carry's row sums on b_t (g_i for i <= t), the
    summary's on b_C - b_j (g_i for i > j), p <H_in, dH> on b_C (all g_i in the chunk).

    Two passes over blocks of chunks: forward, keeping only the state entering each
    block ([n_blocks, B, H, K, V]); then backward, recomputing each block's chunk
    states and intra-chunk terms. Returns dq, dk, dv, dg (None without g), dh0 (None
    without h0), [B, T, ...] in the compute dtype.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    cdt = compute_dtype(q.dtype)
    C = chunk_size
    dh = torch.zeros(B, H, K, V, dtype=cdt, device=q.device) if dht is None else finite(dht.to(cdt))
    if T == 0:
        zq, zv = q.new_zeros(B, 0, H, K, dtype=cdt), q.new_zeros(B, 0, H, V, dtype=cdt)
        dg = None if g is None else q.new_zeros(B, 0, H, dtype=cdt)
        return zq, zq.clone(), zv, dg, (None if h0 is None else dh)
    blocks = _blocks(T, C, B * H * (K + V))

    def block(t0: int, t1: int, states_only: bool = False) -> _Chunks:
        # the first pass needs only the states: no q, no in-chunk decays
        return _prepare(None if states_only else q[:, t0:t1], k[:, t0:t1], v[:, t0:t1],
                        _part(g, t0, t1), _part(resets, t0, t1), C, intra=not states_only)

    with torch.no_grad():
        h = (torch.zeros(B, H, K, V, dtype=cdt, device=q.device) if h0 is None
             else finite(h0.to(cdt)))
        entries = []
        for t0, t1 in blocks[:-1]:
            entries.append(h)
            h = _incoming_states(block(t0, t1, states_only=True), h)[1].contiguous()
        entries.append(h)
        dq = q.new_empty(B, T, H, K, dtype=cdt)
        dk = q.new_empty(B, T, H, K, dtype=cdt)
        dv = q.new_empty(B, T, H, V, dtype=cdt)
        dg = None if g is None else q.new_empty(B, T, H, dtype=cdt)
        for (t0, t1), h_entry in zip(reversed(blocks), reversed(entries)):
            ch = block(t0, t1)
            N = ch.qc.shape[2]
            d = do[:, t0:t1].to(cdt)
            if ch.pad:
                d = F.pad(d, (0, 0, 0, 0, 0, ch.pad))
            doc = finite(_heads_first(d, B, N, C, H), do)  # [B, H, N, C, V]
            bq, bk, bv, bg, dh = _block_backward(ch, h_entry, doc, dh, g is not None)
            dq[:, t0:t1] = _to_tokens(bq, t1 - t0)
            dk[:, t0:t1] = _to_tokens(bk, t1 - t0)
            dv[:, t0:t1] = _to_tokens(bv, t1 - t0)
            if dg is not None and bg is not None:
                dg[:, t0:t1] = _tokens_of_chunk_values(bg, t1 - t0)
        return dq, dk, dv, dg, (None if h0 is None else dh.contiguous())


class _ChunkFunction(torch.autograd.Function):
    """Autograd of the chunk path that saves only its inputs (see the module note)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None,
        resets: Tensor | None, h0: Tensor | None, chunk_size: int,
    ) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(q, k, v, g, resets, h0)
        ctx.chunk_size = chunk_size
        o, h = chunk_forward(q, k, v, g, resets, h0, chunk_size)
        poison_outputs(o, h, k, v, g, resets, h0)
        return o, h

    @staticmethod
    def backward(ctx: Any, do: Tensor, dht: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, g, resets, h0 = ctx.saved_tensors
        dq, dk, dv, dg, dh0 = chunk_backward(q, k, v, g, resets, h0, do, dht, ctx.chunk_size)
        poison_grads([dq, dk, dv, dg], dh0, q, k, v, g, resets, h0, do, dht)
        return (
            dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
            None if dg is None else dg.to(g.dtype), None,
            None if dh0 is None else dh0.to(h0.dtype), None,
        )


def chunk_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    *,
    resets: torch.Tensor | None = None,
    h0: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decayed causal linear attention, chunk-parallel, differentiable.

    Args:
        q: [B, T, H, K], already multiplied by the scale.
        k: [B, T, H, K].
        v: [B, T, H, V].
        g: [B, T, H] log-decay (<= 0; -inf is a hard reset), or None for no decay.
        resets: [B, T] bool, True where a new segment starts (its carry is cut);
            position 0 must be False: the carry into position 0 is ``h0``.
        h0: [B, H, K, V] carry into position 0, or None for zero.
        chunk_size: C, the chunk length.

    Returns:
        o: [B, T, H, V] and the state after the last token, [B, H, K, V], both in the
        compute dtype (fp32, or fp64 for fp64 inputs).
    """
    return _ChunkFunction.apply(q, k, v, g, resets, h0, chunk_size)


def segment_summary(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summary of a whole segment from a zero state: one weighted K^T V.

    Args:
        k: [B, L, H, K], v: [B, L, H, V], g: [B, L, H] or None.

    Returns:
        h: [B, H, K, V] = sum_j exp(A_L - A_j) k_j v_j^T (compute dtype), and
        a: [B, H], the segment's total log-decay A_L.
    """
    cdt = compute_dtype(k.dtype)
    B, _L, H, _ = k.shape
    # clean operands, the poison put back by a flag (hla_sp.ops.isolation): a token cut
    # off by a later hard reset has weight 0, and 0 * NaN would still be NaN
    reach = poisoned_prefix(bad_tokens(k, v, g), cuts(None, g, k))[:, -1] if _L else None
    k, v = finite(k.to(cdt)), finite(v.to(cdt))
    if g is None:
        h = torch.einsum("blhk,blhv->bhkv", k, v)
        total = torch.zeros(B, H, dtype=cdt, device=k.device)
    else:
        # exp(A_L - A_j) as the exp of a suffix sum: A_L - A_j cancels catastrophically
        # in fp32 once |A_L| is large (a long shard: |A_L| ~ 1e4 costs ~1e-3 relative).
        suffix = finite_decay(g.to(cdt)).flip(1).cumsum(1).flip(1)  # sum_{i >= j} g_i
        total = suffix[:, 0]
        w = torch.exp(F.pad(suffix[:, 1:], (0, 0, 0, 1)))  # sum_{i > j} g_i
        h = torch.einsum("blhk,blhv->bhkv", k * w[..., None], v)
    if reach is not None:
        h = torch.where(reach[..., None, None], float("nan"), h)
    return h, total


def with_carry_terms(
    o: Tensor, q: Tensor, g: Tensor | None, spans: Sequence[tuple[int, int, Tensor]]
) -> Tensor:
    """o [B, T, H, V] with, on each span [s, e) (disjoint, in order), the term of the
    state h [B, H, K, V] carried into it: :func:`carry_term` of that span. A new tensor
    (no in-place write on o, which autograd may hold)."""
    if not spans:
        return o
    parts, at = [], 0
    for s, e, h in spans:
        term = carry_term(q[:, s:e], None if g is None else g[:, s:e], h)
        parts += [o[:, at:s], o[:, s:e] + term]
        at = e
    parts.append(o[:, at:])
    return torch.cat(parts, dim=1)


def carry_term(q: torch.Tensor, g: torch.Tensor | None, h0: torch.Tensor) -> torch.Tensor:
    """What a carry-in state adds to a segment's outputs: exp(A_t) q_t^T h0.

    Args:
        q: [B, L, H, K] (scaled), g: [B, L, H] or None, h0: [B, H, K, V].

    Returns:
        [B, L, H, V] in the compute dtype.
    """
    cdt = compute_dtype(q.dtype)
    # clean operands (a q_t after a hard reset must not bring a NaN into h0's gradient),
    # and a non-finite h0's poison put back on the tokens it reaches
    out = torch.einsum("blhk,bhkv->blhv", finite(q.to(cdt)), finite(h0.to(cdt)))
    reach = bad_state(h0)[:, None]  # [B, 1, H]
    if g is not None:
        A = finite_decay(g.to(cdt)).cumsum(1)
        out = out * torch.exp(A)[..., None]
        reach = reach & ~torch.isneginf(A)  # up to the first hard reset
    return torch.where(reach[..., None], float("nan"), out)

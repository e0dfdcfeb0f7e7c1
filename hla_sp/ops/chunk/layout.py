"""Cutting a block of tokens into chunks, the decay weights of every chunk, and back.

The forward and backward run over blocks of whole chunks (:func:`block_ranges`); each
block is cut by :func:`prepare` into heads-first chunk tensors [B, H, N, C, .] and
the per-chunk weights of the chunk algebra (:mod:`hla_sp.ops.chunk.algebra`).

Multi-query (G query heads per kv head, GQA): q [B, T, H G, K] against k, v of H
heads. Every state piece (summaries, pass factors) is built once per kv head; the
group's queries are extra rows of the chunk's query block, row c G + j being token c
of query head h G + j, so the query-side tensors are [B, H, N, C G, .] and the
in-chunk mask of a row is that of its token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hla_sp.ops.dispatch import compute_dtype
from hla_sp.ops.isolation import finite, finite_decay

Tensor = torch.Tensor


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
class Chunks:
    """Inputs cut into chunks, heads first, and the decay weights of every chunk.

    qc: [B, H, N, C G, K] (G query rows per token, row c G + j: query head h G + j);
    kc: [B, H, N, C, K]; vc: [B, H, N, C, V] (compute dtype, zero-padded).
    D: [B, H, N, C G, C] in-chunk decay exp(segsum) of each query row's token, 0 where
        masked (causal, resets).
    wc: [B, H, N, C G] weight of the incoming state for each query row, exp(b_t).
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
    G: int = 1


def per_token(x: Tensor, G: int) -> Tensor:
    """[..., C G] per query row -> [..., C] per token: the sum over a token's G rows."""
    return x if G == 1 else x.unflatten(-1, (-1, G)).sum(-1)


def rows(x: Tensor | None, G: int) -> Tensor | None:
    """[..., C, D] per token -> [..., C G, D]: each token's row repeated for its G query
    rows (a query-side weight or mask)."""
    return x if x is None or G == 1 else x.repeat_interleave(G, dim=-2)


def weighted(x: Tensor, w: Tensor | None) -> Tensor:
    """x [..., C, D] times a per-token weight w [..., C]; w None (all ones) costs no copy."""
    return x if w is None else x * w[..., None]


def heads_first(x: Tensor, B: int, N: int, C: int, H: int) -> Tensor:
    """[B, N C, H, D] -> [B, H, N, C, D], contiguous: batched matmuls on a permuted view
    copy per batch and run several times slower (measured 10x for [1, 4, 256, 64, 64])."""
    return x.reshape(B, N, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4).contiguous()


def cut_tokens(x: Tensor, C: int, dtype: torch.dtype, clean: bool = True) -> Tensor:
    """[B, T, H, D] -> [B, H, N, C, D] in ``dtype`` (the compute dtype), zero-padded to whole chunks
    and, with ``clean``, with every NaN and ±inf set to 0 (:mod:`hla_sp.ops.isolation`:
    a zero weight must mean nothing, and a matmul gives 0 * NaN = NaN). One new tensor:
    the cleaning runs in place on the heads-first copy."""
    B, T, H, _ = x.shape
    N = -(-T // C)
    y = x.to(dtype)
    if N * C != T:
        # Padding at the end with q = k = v = 0 and g = 0 leaves the state unchanged.
        y = F.pad(y, (0, 0, 0, 0, 0, N * C - T))
    y = heads_first(y, B, N, C, H)
    return finite(y, x) if clean else y


def prepare(
    q: Tensor | None, k: Tensor | None, v: Tensor | None, g: Tensor | None,
    resets: Tensor | None, C: int, intra: bool = True, clean_q: bool = True,
    clean: bool = True,
) -> Chunks:
    """Cut a block [B, T, H, .] into chunks of C tokens; ``intra=False`` skips D (the
    [C, C] in-chunk decays, the costly part), for passes that only touch the states,
    and a None among q, k, v skips that tensor's heads-first copy (its field is then
    None).

    The copies are clean (:mod:`hla_sp.ops.isolation`): non-finite entries are 0, and
    a NaN or +inf log-decay is 0; the callers put the poison back by flags. A forward
    may pass ``clean_q=False``: a non-finite q_t only reaches o_t, which it should;
    ``clean=False`` cleans nothing (inputs known finite).

    q may have G times the heads of k and v (multi-query, module note); G = 1 when
    q, or both k and v, are None."""
    ref = next(x for x in (k, v, q) if x is not None)
    B, T, H, _ = ref.shape
    N = -(-T // C)
    pad = N * C - T
    cdt = compute_dtype(ref.dtype)
    G = 1 if q is None else q.shape[2] // H
    qc = None
    if q is not None:
        # [B, T, H G, K] as [B, T, H, G K]: one heads-first copy, rows c G + j for free
        qc = cut_tokens(q.reshape(B, T, H, G * q.shape[-1]), C, cdt, clean_q and clean)
        qc = qc.view(B, H, N, C * G, q.shape[-1])
    kc = None if k is None else cut_tokens(k, C, cdt, clean)
    vc = None if v is None else cut_tokens(v, C, cdt, clean)
    causal = torch.ones(C, C, dtype=torch.bool, device=ref.device).tril()
    D: Tensor | None = None
    seg: Tensor | None = None
    if g is None:
        if intra:
            D = causal.to(cdt).expand(B, H, N, C, C)
        wc = ws = None  # all ones: no per-token weight to apply
        p = ref.new_ones(B, H, N, dtype=cdt)
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
        ones = ref.new_ones(B, H, N, C, dtype=cdt)
        ws = torch.where(c == c[..., -1:], ones if ws is None else ws, 0.0)
        wc = torch.where(c == 0, ones if wc is None else wc, 0.0)
        p = torch.where(c[..., -1] == 0, p, 0.0)
    if G > 1:
        D = rows(D, G)
        wc = None if wc is None else rows(wc[..., None], G)[..., 0]
    return Chunks(qc, kc, vc, D, wc, ws, p, T, pad, seg, G)


def to_tokens(x: Tensor, T: int) -> Tensor:
    """[B, H, N, C, D] -> [B, T, H, D] (drops the padding)."""
    B, H, N, C, Dd = x.shape
    return x.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, Dd)[:, :T]


def rows_to_tokens(x: Tensor, T: int, G: int) -> Tensor:
    """Query rows [B, H, N, C G, D] -> [B, T, H, G D] (drops the padding): the caller
    writes it into a view [B, T, H, G D] of its [B, T, H G, D] tensor."""
    B, H, N, R, Dd = x.shape
    return to_tokens(x.view(B, H, N, R // G, G * Dd), T)


def chunk_values_to_tokens(x: Tensor, T: int) -> Tensor:
    """[B, H, N, C] -> [B, T, H] (drops the padding)."""
    B, H, N, C = x.shape
    return x.permute(0, 2, 3, 1).reshape(B, N * C, H)[:, :T]


BLOCK_TOKENS = 512
"""Tokens per block of the blocked forward and backward, at a width B H (K + V) of
BLOCK_WIDTH: every temporary is the size of one block (8 chunks of 64), so the memory a
call adds beyond its inputs and outputs does not grow with T, while each batched matmul
still covers 8 x B x H chunks (docs/benchmarks.md has the measurements)."""

BLOCK_WIDTH = 512
"""A narrower call gets proportionally longer blocks (up to 16x), so that a block holds
about as many elements: at small widths the per-operation overhead of many small
blocks dominates (docs/benchmarks.md)."""


def block_ranges(T: int, C: int, width: int) -> list[tuple[int, int]]:
    """Token ranges [t0, t1) of the blocks: whole chunks, the last one possibly short.
    ``width`` is B H (K + V) of the call."""
    scale = min(16, max(1, BLOCK_WIDTH // max(1, width)))
    step = max(1, BLOCK_TOKENS * scale // C) * C
    return [(t0, min(T, t0 + step)) for t0 in range(0, T, step)]

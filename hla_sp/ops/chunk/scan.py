"""The blocked forward and backward of the chunk path (no autograd: the custom operator
of :mod:`hla_sp.ops.primitive` owns it).

Both run over blocks of whole chunks (:func:`hla_sp.ops.chunk.layout.block_ranges`), so
every temporary is the size of one block; the forward keeps nothing, the backward
recomputes the states from the inputs (see the package note, :mod:`hla_sp.ops.chunk`).
"""

from __future__ import annotations

import torch

from hla_sp.ops.chunk.algebra import addmm, block_backward, incoming_states
from hla_sp.ops.chunk.layout import (
    Chunks,
    block_ranges,
    chunk_values_to_tokens,
    cut_tokens,
    prepare,
    rows_to_tokens,
    to_tokens,
    weighted,
)
from hla_sp.ops.dispatch import compute_dtype
from hla_sp.ops.isolation import finite

Tensor = torch.Tensor


def _part(x: Tensor | None, t0: int, t1: int) -> Tensor | None:
    return None if x is None else x[:, t0:t1]


def _carry(h: Tensor, cdt: torch.dtype, clean: bool) -> Tensor:
    """A carried state [B, H, K, V] in the compute dtype: a new tensor (never an alias
    of h), non-finite entries set to 0 with ``clean``."""
    return finite(h.to(cdt)) if clean else h.to(cdt, copy=True)


def chunk_forward(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, resets: Tensor | None,
    h0: Tensor | None, chunk_size: int, clean: bool = True,
) -> tuple[Tensor, Tensor]:
    """Decayed causal linear attention, forward, without autograd, block by block.

    Args:
        q: [B, T, H G, K], already multiplied by the scale; k: [B, T, H, K];
            v: [B, T, H, V]. G > 1 is multi-query: query head h G + j reads the state
            of kv head h, built once (:mod:`hla_sp.ops.chunk.layout`).
        g: [B, T, H] log-decay (<= 0; -inf is a hard reset), or None for no decay.
        resets: [B, T] bool, True where a new segment starts (its carry is cut);
            position 0 must be False: the carry into position 0 is ``h0``.
        h0: [B, H, K, V] carry into position 0, or None for zero.
        chunk_size: C, the chunk length.
        clean: clean the operands (non-finite entries to 0); False when the caller
            knows k, v and h0 finite (:func:`hla_sp.ops.isolation.known_finite`).

    Returns o [B, T, H G, V] (contiguous) and h_last [B, H, K, V], in the compute dtype,
    computed on clean operands: the caller puts the poison of non-finite inputs back
    (:func:`hla_sp.ops.isolation.poison_outputs`).
    """
    B, T, Hq, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    G = Hq // H
    cdt = compute_dtype(q.dtype)
    # clean, and never an alias of h0 (the caller puts a non-finite h0's poison back)
    h = (torch.zeros(B, H, K, V, dtype=cdt, device=q.device) if h0 is None
         else _carry(h0, cdt, clean))
    if T == 0:  # an empty shard: no outputs, and the carry passes through unchanged
        return q.new_zeros(B, 0, Hq, V, dtype=cdt), h
    o = q.new_empty(B, T, Hq, V, dtype=cdt)
    og = o.view(B, T, H, G * V)
    with torch.no_grad():
        for t0, t1 in block_ranges(T, chunk_size, B * H * (G * K + V)):
            ch = prepare(q[:, t0:t1], k[:, t0:t1], v[:, t0:t1], _part(g, t0, t1),
                         _part(resets, t0, t1), chunk_size, clean_q=False, clean=clean)
            h_in, h = incoming_states(ch, h)
            attn = (ch.qc @ ch.kc.transpose(-1, -2)).mul_(ch.D)  # [B, H, N, C, C]
            ob = addmm(attn @ ch.vc, weighted(ch.qc, ch.wc), h_in)
            del attn
            og[:, t0:t1] = rows_to_tokens(ob, t1 - t0, G)
    return o, h.contiguous()


def chunk_backward(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, resets: Tensor | None,
    h0: Tensor | None, do: Tensor, dht: Tensor | None, chunk_size: int, clean: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Gradients of :func:`chunk_forward` from its inputs alone (everything recomputed;
    ``clean`` as there, for q, k, v, do, h0 and dht).

    With the cotangents do [B, T, H G, V] and dht [B, H, K, V] (or None), per chunk
    (multi-query: Q, dO, wc and D over the chunk's C G query rows), with
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
    B, T, Hq, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    G = Hq // H
    cdt = compute_dtype(q.dtype)
    C = chunk_size
    dh = (torch.zeros(B, H, K, V, dtype=cdt, device=q.device) if dht is None
          else _carry(dht, cdt, clean))
    if T == 0:
        zk, zv = q.new_zeros(B, 0, H, K, dtype=cdt), q.new_zeros(B, 0, H, V, dtype=cdt)
        dg = None if g is None else q.new_zeros(B, 0, H, dtype=cdt)
        return (q.new_zeros(B, 0, Hq, K, dtype=cdt), zk, zv, dg,
                (None if h0 is None else dh))
    blocks = block_ranges(T, C, B * H * (G * K + V))

    def block(t0: int, t1: int, states_only: bool = False) -> Chunks:
        # the first pass needs only the states: no q, no in-chunk decays
        return prepare(None if states_only else q[:, t0:t1], k[:, t0:t1], v[:, t0:t1],
                       _part(g, t0, t1), _part(resets, t0, t1), C, intra=not states_only,
                       clean=clean)

    with torch.no_grad():
        h = (torch.zeros(B, H, K, V, dtype=cdt, device=q.device) if h0 is None
             else _carry(h0, cdt, clean))
        entries = []
        for t0, t1 in blocks[:-1]:
            entries.append(h)
            h = incoming_states(block(t0, t1, states_only=True), h)[1].contiguous()
        entries.append(h)
        dq = q.new_empty(B, T, Hq, K, dtype=cdt)
        dqg = dq.view(B, T, H, G * K)
        dk = q.new_empty(B, T, H, K, dtype=cdt)
        dv = q.new_empty(B, T, H, V, dtype=cdt)
        dg = None if g is None else q.new_empty(B, T, H, dtype=cdt)
        for (t0, t1), h_entry in zip(reversed(blocks), reversed(entries)):
            ch = block(t0, t1)
            # [B, H, N, C G, V]: the cotangent's rows are the query rows
            do_chunks = cut_tokens(do[:, t0:t1].reshape(B, t1 - t0, H, G * V), C, cdt, clean)
            do_chunks = do_chunks.view(*do_chunks.shape[:3], -1, V)
            bq, bk, bv, bg, dh = block_backward(ch, h_entry, do_chunks, dh, g is not None)
            dqg[:, t0:t1] = rows_to_tokens(bq, t1 - t0, G)
            dk[:, t0:t1] = to_tokens(bk, t1 - t0)
            dv[:, t0:t1] = to_tokens(bv, t1 - t0)
            if dg is not None and bg is not None:
                dg[:, t0:t1] = chunk_values_to_tokens(bg, t1 - t0)
        return dq, dk, dv, dg, (None if h0 is None else dh.contiguous())



"""The chunk path split around a carry-in state that arrives late (sequence parallelism).

Under sequence parallelism a shard's carry-in state comes from an exchange that
itself needs the shard's summary. Written as zero-state outputs plus a carry term,
a shard pays for its summary, the carry term and both their backwards on top of the
chunk path: six more K x V matmuls per token, a third of the chunk path's work at
K = V = 32. Split instead where the exchange starts and ends, the same chunk algebra
(:mod:`hla_sp.ops.chunk`) costs nothing extra, and the exchange still travels while
the expensive in-chunk terms are computed:

forward
  1. :meth:`SplitChunks.summary`: the chunk summaries and the zero-state scan, giving
     h_in^0 per chunk and the shard's summary          -> the exchange starts
  2. :meth:`SplitChunks.intra`: the in-chunk outputs (Q K^T ⊙ D) V
                                                        -> the exchange ends
  3. :meth:`SplitChunks.outputs`: + (Q ⊙ wc) h_in with h_in = h_in^0 + before_n h_init,
     before_n the product of the pass factors of the chunks before n

backward
  1. :meth:`SplitChunks.carry_grad`: dH_in of every chunk from dO alone; that of
     chunk 0 is d h_init                                -> the reverse exchange starts
  2. :meth:`SplitChunks.local`: every gradient term that needs only dO: dQ whole,
     the in-chunk parts of dK, dV and dg                -> the reverse exchange ends
  3. :meth:`SplitChunks.finish`: with dS, the summary's gradient, the states' gradient
     is dH_out = dH_out^loc + after_n dS (after_n the product of the pass factors after n),
     and the terms through it complete dK, dV and dg.

The decay's gradient through the pass factors is p <h_in, dH_out> for the outputs
(h_in with h_init) and p <h_in^0, after dS> for the summary (zero state); it is
computed as p <h_in^0, dH_out> + p before <h_init, dH_out^loc>, with no subtraction.

Memory: between the steps a shard keeps its per-chunk states ([B, H, N, K, V], N = L / C),
the chunked inputs the next step reads (each input is cut into chunks once per
direction, as the one-call path does: forward K, V from step 1 to 2 and Q from 2 to 3;
backward Q and dO from step 1 to 2 and K, V from 2 to 3) and, in backward, the
gradients being built. So a sharded stage holds up to about four input-sized tensors
more than the one-call path, between its steps only; the autograd graph still keeps
nothing but the inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hla_sp.ops.chunk.algebra import (
    addmm,
    incoming_states,
    local_grads,
    reverse_states,
    state_grads,
)
from hla_sp.ops.chunk.layout import (
    Chunks,
    block_ranges,
    chunk_values_to_tokens,
    cut_tokens,
    prepare,
    to_tokens,
    weighted,
)
from hla_sp.ops.dispatch import compute_dtype
from hla_sp.ops.isolation import (
    bad_rows,
    bad_state,
    bad_tokens,
    cuts,
    finite,
    poison_,
    poison_segments,
    poisoned_prefix,
)

Tensor = torch.Tensor


def _exclusive_cumprod(p: Tensor, reverse: bool = False) -> Tensor:
    """[..., N] -> the product of p over the chunks before (after, ``reverse``) each."""
    if reverse:
        return _exclusive_cumprod(p.flip(-1)).flip(-1)
    return F.pad(p[..., :-1], (1, 0), value=1.0).cumprod(-1)


class SplitChunks:
    """One shard's chunk path in the steps above (inputs already validated).

    Args:
        q: [B, L, H, K] scaled; k: [B, L, H, K]; v: [B, L, H, V]; g: [B, L, H] or None;
            resets: [B, L] bool or None (document starts inside the shard); all in the
            compute dtype, without autograd history (the callers' Functions own it).
        chunk_size: C.
    """

    def __init__(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, resets: Tensor | None,
        chunk_size: int,
    ) -> None:
        self.q, self.k, self.v, self.g, self.resets = q, k, v, g, resets
        self.C = chunk_size
        B, L, H, K = q.shape
        self.B, self.L, self.H, self.K, self.V = B, L, H, K, v.shape[-1]
        self.cdt = compute_dtype(q.dtype)
        self.blocks = block_ranges(L, chunk_size, B * H * (K + self.V))
        # Kept from one step to the next, per block, and dropped when no longer needed.
        self.h_in0: list | None = None  # [B, H, Nb, K, V] zero-state incoming states
        self.p: list | None = None  # [B, H, Nb] pass factors
        self.o: list | None = None  # [B, H, Nb, C, V] outputs being built
        self.dh_in: list | None = None  # [B, H, Nb, K, V] dH_in from dO alone
        self.dlp_init: list | None = None  # [B, H, Nb] see local()
        self.grads: list | None = None  # dq, and per block dk, dv, dg being built
        # Each block's chunks, kept from one step to the next, so that every input is
        # cut into chunks once per pass direction (as the one-call path does); each step
        # drops what the next does not use.
        self.cut: list[Chunks] | None = None
        self.do_chunks: list[Tensor] | None = None  # [B, H, Nb, C, V] dO cut into chunks
        # Isolation (hla_sp.ops.isolation): the chunks are clean copies, and the poison
        # of non-finite inputs goes back by these [B, L, H] flags.
        self.bad = bad_tokens(k, v, g)  # reaches the later outputs of its segment
        self.bad_q = bad_rows(q)  # reaches its own output
        self.bad_do: Tensor | None = None
        self.seg_cut = cuts(resets, g, k)
        self.init_bad: Tensor | None = None  # [B, H]: a non-finite carried-in state

    def _chunks(self, t0: int, t1: int, intra: bool, need: str = "qkv") -> Chunks:
        """The block [t0, t1) cut into chunks, with heads-first copies of ``need`` only."""
        g = None if self.g is None else self.g[:, t0:t1]
        r = None if self.resets is None else self.resets[:, t0:t1]
        q, k, v = (x[:, t0:t1] if name in need else None
                   for name, x in zip("qkv", (self.q, self.k, self.v)))
        return prepare(q, k, v, g, r, self.C, intra=intra)

    def _states(self) -> Tensor:
        """The zero-state scan: per block h_in^0 [B, H, Nb, K, V] and p [B, H, Nb] (kept,
        and the blocks' K, V chunks); returns the state after the piece."""
        self.h_in0, self.p, self.cut = [], [], []
        h = self.q.new_zeros(self.B, self.H, self.K, self.V)
        for t0, t1 in self.blocks:
            ch = self._chunks(t0, t1, intra=False, need="kv")
            h_in0, h = incoming_states(ch, h)
            self.h_in0.append(h_in0)
            self.p.append(ch.p)
            self.cut.append(ch)
        return h

    def _with_init(self, i: int, before: Tensor, h_init: Tensor | None) -> Tensor:
        """Block i's incoming states with h_init carried in: h_in^0 + before h_init, before
        [B, H, Nb] being the block's products of the earlier pass factors."""
        if h_init is None:
            return self.h_in0[i]
        return torch.addcmul(self.h_in0[i], before[..., None, None],
                             h_init.to(self.cdt)[:, :, None])

    # forward -----------------------------------------------------------------------

    def summary(self) -> Tensor:
        """Step 1: the shard's state from a zero state, [B, H, K, V] (a new tensor), NaN
        where a non-finite input of its last segment reaches it."""
        h = self._states().contiguous()
        return poison_(h, poisoned_prefix(self.bad, self.seg_cut)[:, -1])

    def _clean_init(self, h_init: Tensor | None) -> Tensor | None:
        """h_init cleaned, its poison kept as a flag (``init_bad``)."""
        if h_init is None:
            return None
        self.init_bad = bad_state(h_init)
        return finite(h_init)

    def intra(self) -> None:
        """Step 2: the in-chunk outputs, per block [B, H, Nb, C, V]."""
        self.o = []
        for i, (t0, t1) in enumerate(self.blocks):
            ch = self._chunks(t0, t1, intra=True, need="q")
            kc, vc = self.cut[i].kc, self.cut[i].vc
            attn = (ch.qc @ kc.transpose(-1, -2)).mul_(ch.D)
            self.o.append(attn @ vc)
            ch.D = None
            self.cut[i] = ch  # Q for the outputs; K, V no longer needed

    def outputs(self, h_init: Tensor | None) -> Tensor:
        """Step 3: o [B, L, H, V] with the carry-in state h_init [B, H, K, V] (or None)."""
        if self.o is None:
            self.intra()
        h_init = self._clean_init(h_init)
        before = _products(self.p)
        o = self.q.new_empty(self.B, self.L, self.H, self.V)
        for i, (t0, t1) in enumerate(self.blocks):
            ch = self.cut[i]
            ob = addmm(self.o[i], weighted(ch.qc, ch.wc), self._with_init(i, before[i], h_init))
            self.o[i] = self.cut[i] = None
            o[:, t0:t1] = to_tokens(ob, t1 - t0)
        self.h_in0 = self.p = self.o = self.cut = None
        reach = poisoned_prefix(self.bad, self.seg_cut, self.init_bad) | self.bad_q
        return poison_(o, reach)

    # backward ----------------------------------------------------------------------

    def carry_grad(self, do: Tensor) -> Tensor:
        """Backward step 1: d h_init [B, H, K, V] from the outputs' cotangent do."""
        self.bad_do = bad_rows(do)
        n = len(self.blocks)
        self.dh_in, self.cut, self.do_chunks = [None] * n, [None] * n, [None] * n
        dh = None
        for i in reversed(range(n)):
            t0, t1 = self.blocks[i]
            ch = self._chunks(t0, t1, intra=False, need="q")
            self.cut[i], self.do_chunks[i] = ch, cut_tokens(do[:, t0:t1], self.C, self.cdt)
            self.dh_in[i] = reverse_states(ch, self.do_chunks[i], dh)
            dh = self.dh_in[i][:, :, 0]
        return dh.clone()

    def local(self, h_init: Tensor | None) -> None:
        """Backward step 2: the terms that need only dO (after :meth:`carry_grad`)."""
        B, L, H = self.B, self.L, self.H
        want_dg = self.g is not None
        h_init = self._clean_init(h_init)
        dq = self.q.new_empty(B, L, H, self.K)
        partial: list[tuple[Tensor, Tensor, Tensor | None]] = []
        self.h_in0, self.p, self.dlp_init = [], [], []
        h = self.q.new_zeros(B, H, self.K, self.V)
        run = self.q.new_ones(B, H)  # the product of the pass factors so far
        for i, (t0, t1) in enumerate(self.blocks):
            ch = self._chunks(t0, t1, intra=True, need="kv")
            ch.qc = self.cut[i].qc
            do_chunks = self.do_chunks[i]
            self.do_chunks[i] = None
            # the zero-state scan, block by block in order, and h_init on top
            h_in0, h = incoming_states(ch, h)
            self.h_in0.append(h_in0)
            self.p.append(ch.p)
            before, run = _block_products(run, ch.p)
            h_in = self._with_init(i, before, h_init)
            bq, bk, bv, bg = local_grads(ch, h_in, do_chunks, want_dg)
            ch.qc = ch.D = None
            self.cut[i] = ch  # K, V for the state terms
            dq[:, t0:t1] = to_tokens(bq, t1 - t0)
            partial.append((bk, bv, bg))  # completed in place by finish()
            if want_dg and h_init is not None:
                # p before <h_init, dH_out^loc>: the outputs' share of the pass factors'
                # gradient that h_in^0 (the zero-state scan) does not carry
                self.dlp_init.append(ch.p * before * torch.einsum(
                    "bhkv,bhnkv->bhn", h_init.to(self.cdt), self._dh_out_local(i)))
        self.grads = [dq, partial]
        self.do_chunks = None

    def _dh_out_local(self, i: int) -> Tensor:
        """Block i's dH_out^loc [B, H, Nb, K, V], the gradient of the state leaving each of
        its chunks, from dO alone: the next chunk's dH_in."""
        Nb = self.p[i].shape[2]
        if self.dh_in is None:
            return self.q.new_zeros(self.B, self.H, Nb, self.K, self.V)
        after = (self.dh_in[i + 1][:, :, :1] if i + 1 < len(self.blocks)
                 else self.q.new_zeros(self.B, self.H, 1, self.K, self.V))
        return torch.cat([self.dh_in[i][:, :, 1:], after], dim=2)

    def finish(self, dS: Tensor | None) -> list[Tensor | None]:
        """Backward step 3: with dS [B, H, K, V], the gradient of :meth:`summary`'s state,
        the whole gradients dq, dk, dv [B, L, H, *] and dg [B, L, H] (None without g).
        Without steps 1-2 (the outputs had no gradient) the local terms are 0.
        Every gradient of a segment that holds a non-finite input is NaN."""
        B, L, H = self.B, self.L, self.H
        last = bad_state(dS)
        if dS is not None:
            dS = finite(dS)
        if self.grads is None:
            self._states()
            self.dlp_init = []
            dq, partial = self.q.new_zeros(B, L, H, self.K), None
        else:
            dq, partial = self.grads
        want_dg = self.g is not None
        dk = self.q.new_empty(B, L, H, self.K)
        dv = self.q.new_empty(B, L, H, self.V)
        dg = self.q.new_empty(B, L, H) if want_dg else None
        after = _products(self.p, reverse=True)
        for i, (t0, t1) in enumerate(self.blocks):
            ch = self.cut[i]
            self.cut[i] = None
            dh_out = self._dh_out_local(i)
            if dS is not None:
                dh_out.addcmul_(after[i][..., None, None], dS.to(self.cdt)[:, :, None])
            if partial is None:
                bk, bv = torch.zeros_like(ch.kc), torch.zeros_like(ch.vc)
                bg = torch.zeros_like(ch.wc) if want_dg else None
            else:
                bk, bv, bg = partial[i]
                partial[i] = None
            if bg is not None and self.dlp_init:
                bg += self.dlp_init[i][..., None]
            state_grads(ch, self.h_in0[i], dh_out, bk, bv, bg)
            dk[:, t0:t1] = to_tokens(bk, t1 - t0)
            dv[:, t0:t1] = to_tokens(bv, t1 - t0)
            if dg is not None:
                dg[:, t0:t1] = chunk_values_to_tokens(bg, t1 - t0)
        self.h_in0 = self.p = self.dh_in = self.grads = self.dlp_init = self.cut = None
        bad = self.bad | self.bad_q
        if self.bad_do is not None:
            bad |= self.bad_do
        poison_segments([dq, dk, dv, dg], [], bad, self.seg_cut, self.init_bad, last)
        return [dq, dk, dv, dg]


def _products(ps: list[Tensor], reverse: bool = False) -> list[Tensor]:
    """Per block, the product of the pass factors of all the piece's chunks before
    (``reverse``: after) each of its chunks; ps: per block [B, H, Nb]."""
    out: list[Tensor] = [ps[0]] * len(ps)
    run = torch.ones_like(ps[0][..., 0])
    for i in (reversed(range(len(ps))) if reverse else range(len(ps))):
        out[i], run = _block_products(run, ps[i], reverse)
    return out


def _block_products(run: Tensor, p: Tensor, reverse: bool = False) -> tuple[Tensor, Tensor]:
    """One block of :func:`_products`: with ``run`` [B, H] the product of the pass
    factors of the blocks before (after) it, the products for its chunks [B, H, Nb] and
    the running product past it."""
    return run[..., None] * _exclusive_cumprod(p, reverse), run * p.prod(-1)

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
  3. :meth:`SplitChunks.outputs`: + (Q ⊙ wc) h_in with h_in = h_in^0 + cp h_init,
     cp_n the product of the pass factors of the chunks before n

backward
  1. :meth:`SplitChunks.carry_grad`: dH_in of every chunk from dO alone; that of
     chunk 0 is d h_init                                -> the reverse exchange starts
  2. :meth:`SplitChunks.local`: every gradient term that needs only dO: dQ whole,
     the in-chunk parts of dK, dV and dg                -> the reverse exchange ends
  3. :meth:`SplitChunks.finish`: with dS, the summary's gradient, the states' gradient
     is dH_out = dH_out^loc + cpr dS (cpr_n the product of the pass factors after n),
     and the terms through it complete dK, dV and dg.

The decay's gradient through the pass factors is p <h_in, dH_out> for the outputs
(h_in with h_init) and p <h_in^0, cpr dS> for the summary (zero state); it is
computed as p <h_in^0, dH_out> + p cp <h_init, dH_out^loc>, with no subtraction.

Memory: between the steps a shard keeps [B, H, N, K, V] per-chunk states (N = L / C)
and, in backward, its gradients; every other temporary is one block's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hla_sp.ops.chunk import (
    _blocks,
    _Chunks,
    _heads_first,
    _incoming_states,
    _local_grads,
    _prepare,
    _reverse_states,
    _state_grads,
    _to_tokens,
)
from hla_sp.ops.precision import compute_dtype

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
        self.blocks = _blocks(L, chunk_size)
        self.N = -(-L // chunk_size)
        # Kept from one step to the next, and dropped when no longer needed.
        self.h_in0: Tensor | None = None  # [B, H, N, K, V] zero-state incoming states
        self.p: Tensor | None = None  # [B, H, N] pass factors
        self.o: Tensor | None = None  # [B, L, H, V] outputs being built
        self.do: Tensor | None = None  # [B, L, H, V] the outputs' cotangent
        self.dh_in: Tensor | None = None  # [B, H, N, K, V] dH_in from dO alone
        self.grads: list[Tensor | None] | None = None  # dq, dk, dv, dg being built

    def _chunks(self, t0: int, t1: int, intra: bool, need: str = "qkv") -> _Chunks:
        """The block [t0, t1) cut into chunks, with heads-first copies of ``need`` only."""
        g = None if self.g is None else self.g[:, t0:t1]
        r = None if self.resets is None else self.resets[:, t0:t1]
        q, k, v = (x[:, t0:t1] if name in need else None
                   for name, x in zip("qkv", (self.q, self.k, self.v)))
        return _prepare(q, k, v, g, r, self.C, intra=intra)

    def _n(self, t0: int, ch: _Chunks) -> slice:
        """The chunks of ``ch`` (the block starting at t0) among the piece's N."""
        return slice(t0 // self.C, t0 // self.C + ch.p.shape[2])

    def _states(self) -> tuple[Tensor, Tensor, Tensor]:
        """The zero-state scan: h_in^0 [B, H, N, K, V], p [B, H, N] and the last state."""
        h_in0 = self.q.new_empty(self.B, self.H, self.N, self.K, self.V)
        p = self.q.new_empty(self.B, self.H, self.N)
        h = self.q.new_zeros(self.B, self.H, self.K, self.V)
        for t0, t1 in self.blocks:
            ch = self._chunks(t0, t1, intra=False, need="kv")
            n = self._n(t0, ch)
            h_in0[:, :, n], h = _incoming_states(ch, h)
            p[:, :, n] = ch.p
        return h_in0, p, h

    def _with_init(self, h_in0: Tensor, h_init: Tensor | None) -> Tensor:
        if h_init is None:
            return h_in0
        cp = _exclusive_cumprod(self.p)
        return h_in0 + cp[..., None, None] * h_init.to(self.cdt)[:, :, None]

    # forward -----------------------------------------------------------------------

    def summary(self) -> Tensor:
        """Step 1: the shard's state from a zero state, [B, H, K, V] (a new tensor)."""
        self.h_in0, self.p, h = self._states()
        return h.contiguous()

    def intra(self) -> None:
        """Step 2: the in-chunk outputs."""
        o = self.q.new_empty(self.B, self.L, self.H, self.V)
        for t0, t1 in self.blocks:
            ch = self._chunks(t0, t1, intra=True)
            attn = (ch.qc @ ch.kc.transpose(-1, -2)).mul_(ch.D)
            o[:, t0:t1] = _to_tokens(attn @ ch.vc, t1 - t0)
        self.o = o

    def outputs(self, h_init: Tensor | None) -> Tensor:
        """Step 3: o [B, L, H, V] with the carry-in state h_init [B, H, K, V] (or None)."""
        if self.o is None:
            self.intra()
        h_in = self._with_init(self.h_in0, h_init)
        o = self.o
        for t0, t1 in self.blocks:
            ch = self._chunks(t0, t1, intra=False, need="q")
            n = self._n(t0, ch)
            inter = (ch.qc * ch.wc[..., None]) @ h_in[:, :, n]
            o[:, t0:t1] += _to_tokens(inter, t1 - t0)
        self.h_in0 = self.p = self.o = None
        return o

    # backward ----------------------------------------------------------------------

    def _doc(self, t0: int, t1: int, ch: _Chunks) -> Tensor:
        d = self.do[:, t0:t1].to(self.cdt)
        if ch.pad:
            d = F.pad(d, (0, 0, 0, 0, 0, ch.pad))
        return _heads_first(d, self.B, ch.p.shape[2], self.C, self.H)

    def carry_grad(self, do: Tensor) -> Tensor:
        """Backward step 1: d h_init [B, H, K, V] from the outputs' cotangent do."""
        self.do = do
        dh_in = self.q.new_empty(self.B, self.H, self.N, self.K, self.V)
        dh = None
        for t0, t1 in reversed(self.blocks):
            ch = self._chunks(t0, t1, intra=False, need="q")
            n = self._n(t0, ch)
            dh_in[:, :, n] = _reverse_states(ch, self._doc(t0, t1, ch), dh)
            dh = dh_in[:, :, n.start]
        self.dh_in = dh_in
        return dh_in[:, :, 0].clone()

    def local(self, h_init: Tensor | None) -> None:
        """Backward step 2: the terms that need only dO (after :meth:`carry_grad`)."""
        B, L, H = self.B, self.L, self.H
        want_dg = self.g is not None
        dq = self.q.new_empty(B, L, H, self.K)
        dk = self.q.new_empty(B, L, H, self.K)
        dv = self.q.new_empty(B, L, H, self.V)
        dg = self.q.new_empty(B, L, H) if want_dg else None
        self.h_in0 = self.q.new_empty(B, H, self.N, self.K, self.V)
        self.p = self.q.new_empty(B, H, self.N)
        h = self.q.new_zeros(B, H, self.K, self.V)
        cp = None
        for t0, t1 in self.blocks:
            ch = self._chunks(t0, t1, intra=True)
            n = self._n(t0, ch)
            # the zero-state scan, block by block (blocks in order), and h_init on top
            self.h_in0[:, :, n], h = _incoming_states(ch, h)
            self.p[:, :, n] = ch.p
            h_in = self.h_in0[:, :, n]
            if h_init is not None:
                # cp of these chunks: the product of every earlier chunk's pass factor
                cp = _exclusive_cumprod(self.p[:, :, : n.stop])[:, :, n]
                h_in = h_in + cp[..., None, None] * h_init.to(self.cdt)[:, :, None]
            bq, bk, bv, bg = _local_grads(ch, h_in, self._doc(t0, t1, ch), want_dg)
            dq[:, t0:t1] = _to_tokens(bq, t1 - t0)
            dk[:, t0:t1] = _to_tokens(bk, t1 - t0)
            dv[:, t0:t1] = _to_tokens(bv, t1 - t0)
            if dg is not None:
                dg[:, t0:t1] = _tokens_of_chunk_values(bg, t1 - t0)
        if want_dg and h_init is not None:
            # p cp <h_init, dH_out^loc>: the outputs' share of the pass factors' gradient
            # that h_in^0 (the zero-state scan) does not carry.
            cp = _exclusive_cumprod(self.p)
            dh_out = self._dh_out_local()
            self.dlp_init = self.p * cp * torch.einsum(
                "bhkv,bhnkv->bhn", h_init.to(self.cdt), dh_out)
        else:
            self.dlp_init = None
        self.grads = [dq, dk, dv, dg]

    def _dh_out_local(self) -> Tensor:
        """dH_out^loc [B, H, N, K, V]: the gradient of the state leaving each chunk, from dO."""
        if self.dh_in is None:
            return self.q.new_zeros(self.B, self.H, self.N, self.K, self.V)
        return F.pad(self.dh_in[:, :, 1:], (0, 0, 0, 0, 0, 1))

    def finish(self, dS: Tensor | None) -> list[Tensor | None]:
        """Backward step 3: with dS [B, H, K, V], the gradient of :meth:`summary`'s state,
        the whole gradients dq, dk, dv [B, L, H, *] and dg [B, L, H] (None without g).
        Without steps 1-2 (the outputs had no gradient) the local terms are 0."""
        if self.grads is None:
            self.h_in0, self.p, _ = self._states()
            z = self.q.new_zeros
            self.grads = [z(self.B, self.L, self.H, self.K), z(self.B, self.L, self.H, self.K),
                          z(self.B, self.L, self.H, self.V),
                          None if self.g is None else z(self.B, self.L, self.H)]
            self.dlp_init = None
        dq, dk, dv, dg = self.grads
        dh_out = self._dh_out_local()
        if dS is not None:
            cpr = _exclusive_cumprod(self.p, reverse=True)
            dh_out.add_(cpr[..., None, None] * dS.to(self.cdt)[:, :, None])
        for t0, t1 in self.blocks:
            ch = self._chunks(t0, t1, intra=False, need="kv")
            n = self._n(t0, ch)
            bk = torch.zeros_like(ch.kc)
            bv = torch.zeros_like(ch.vc)
            bg = None
            if dg is not None:
                bg = torch.zeros_like(ch.wc)
                if self.dlp_init is not None:
                    bg += self.dlp_init[:, :, n, None]
            _state_grads(ch, self.h_in0[:, :, n], dh_out[:, :, n], bk, bv, bg)
            dk[:, t0:t1] += _to_tokens(bk, t1 - t0)
            dv[:, t0:t1] += _to_tokens(bv, t1 - t0)
            if dg is not None:
                dg[:, t0:t1] += _tokens_of_chunk_values(bg, t1 - t0)
        self.h_in0 = self.p = self.do = self.dh_in = self.grads = None
        return [dq, dk, dv, dg]


def _tokens_of_chunk_values(x: Tensor, T: int) -> Tensor:
    """[B, H, N, C] -> [B, T, H] (drops the padding)."""
    B, H, N, C = x.shape
    return x.permute(0, 2, 3, 1).reshape(B, N * C, H)[:, :T]

"""The poison of non-finite inputs, put back after the kernels, gated by the flags.

The kernels compute on clean operands (NaN and ±inf read as 0, :func:`finite`), so a
non-finite value reaches nothing by itself; the promise of the module note of
``hla_sp.ops.isolation`` is kept by writing NaN where the value would have reached:

- forward: o_t (every query head of the group) when a flagged token lies at or before
  t in t's segment, or t's segment is the first and h0 was flagged; h_T when the last
  token's o would be;
- backward: every gradient row of a segment holding a flagged token (forward's or
  backward's), of the first segment when h0 was flagged, of the last when dh_T was;
  dh0 when the first segment is poisoned.

Segments are cut at document starts (``resets``) and log-decays of -inf. One program
per (batch, kv head) reads its gate word first (:mod:`hla_sp.kernels._flags`) and
does nothing else on a 0: finite inputs cost one launch and one word per (b, h). The
work itself (only with a flag raised) is a scan over T in blocks, with a set/reset
carry from block to block (the backward's reverse scan runs forward over the tokens
loaded last to first), and masked stores of NaN.
"""

from __future__ import annotations

import triton.language as tl

from ._jit import jit_helper, lazy_jit


@jit_helper
def _set_reset(r_a, v_a, r_b, v_b):
    """(reset, value) pairs: b after a. A reset clears what came before it; a value sets."""
    return r_a | r_b, v_b | (v_a & (r_b == 0))


@jit_helper
def _cuts(g, r, i_b, i_h, o_t, m_t, T, H, HAS_G: tl.constexpr, HAS_R: tl.constexpr):
    """[BLOCK] int32: 1 where a segment starts (a document start or a log-decay of -inf)."""
    c = tl.zeros(o_t.shape, dtype=tl.int32)
    if HAS_R:
        c = c | (tl.load(r + i_b * T + o_t, mask=m_t, other=0) != 0).to(tl.int32)
    if HAS_G:
        b_g = tl.load(g + (i_b * T + o_t) * H + i_h, mask=m_t, other=0.0)
        c = c | (b_g == float("-inf")).to(tl.int32)
    return c


@jit_helper
def _at(x, o_i, i):
    """The element i of a [BLOCK] int32 vector, as a scalar."""
    return tl.max(tl.where(o_i == i, x, 0), 0)


@jit_helper
def _nan_rows(x, row, m, D, BD: tl.constexpr):
    """NaN into x[row[i], 0:D] where m[i] ([BLOCK] offsets of D-long rows)."""
    for d0 in range(0, D, BD):
        o_d = d0 + tl.arange(0, BD)
        nan = tl.full([row.shape[0], BD], float("nan"), x.dtype.element_ty)
        tl.store(x + row[:, None] + o_d[None, :], nan, mask=m[:, None] & (o_d < D)[None, :])


@jit_helper
def _nan_state(x, i_bh, n, on, BD: tl.constexpr):
    """NaN into the n values of state i_bh of x when ``on``."""
    for d0 in range(0, n, BD):
        o_d = d0 + tl.arange(0, BD)
        nan = tl.full([BD], float("nan"), x.dtype.element_ty)
        m = (o_d < n) & ((tl.zeros([BD], dtype=tl.int32) + on) != 0)  # broadcast: explicit
        tl.store(x + i_bh * n + o_d, nan, mask=m)


@lazy_jit
def poison_fwd_kernel(
    fl,  # [B, T + 2, H] int32 flags of the forward (k, v, decay; h0)
    g,  # [B, T, H] fp32 (HAS_G)
    r,  # [B, T] int32 (HAS_R)
    o,  # [B, T, H G, V]
    ht,  # [B, H, K, V] fp32 (STORE_LAST)
    T,
    H,
    K,
    V,
    G: tl.constexpr,
    BLOCK: tl.constexpr,
    BD: tl.constexpr,
    HAS_G: tl.constexpr,
    HAS_R: tl.constexpr,
    STORE_LAST: tl.constexpr,
):
    """The forward's poison for one (batch, kv head)."""
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    base = fl + i_b * (T + 2) * H + i_h
    o_i = tl.arange(0, BLOCK)
    if tl.load(base + (T + 1) * H) != 0:
        carry = tl.load(base + T * H)  # a flagged h0 poisons the first segment
        for i0 in range(0, T, BLOCK):
            o_t = i0 + o_i
            m_t = o_t < T
            bad = tl.load(base + o_t * H, mask=m_t, other=0)
            cut = _cuts(g, r, i_b, i_h, o_t, m_t, T, H, HAS_G, HAS_R)
            rr, vv = tl.associative_scan((cut, bad), 0, _set_reset)
            pz = vv | (carry & (rr == 0).to(tl.int32))
            carry = _at(pz, o_i, BLOCK - 1)  # tokens past T carry it through
            for j in tl.static_range(G):
                _nan_rows(o, ((i_b * T + o_t) * (H * G) + i_h * G + j) * V, m_t & (pz != 0),
                          V, BD)
        if STORE_LAST:
            _nan_state(ht, i_bh, K * V, carry, BD * BD)


@lazy_jit
def poison_bwd_kernel(
    ff,  # [B, T + 2, H] int32 flags of the forward (k, v, decay; h0)
    fb,  # [B, T + 2, H] int32 flags of the backward (q, do; dh_T); bit 1 is scratch here
    g,  # [B, T, H] fp32 (HAS_G)
    r,  # [B, T] int32 (HAS_R)
    dq,  # [B, T, H G, K]
    dk,  # [B, T, H, K]
    dv,  # [B, T, H, V]
    dg,  # [B, T, H] fp32 (HAS_G)
    dh0,  # [B, H, K, V] fp32 (HAS_INIT)
    T,
    H,
    K,
    V,
    G: tl.constexpr,
    BLOCK: tl.constexpr,
    BD: tl.constexpr,
    HAS_G: tl.constexpr,
    HAS_R: tl.constexpr,
    HAS_INIT: tl.constexpr,
):
    """The backward's poison for one (batch, kv head): whole segments."""
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    bf = ff + i_b * (T + 2) * H + i_h
    bb = fb + i_b * (T + 2) * H + i_h
    o_i = tl.arange(0, BLOCK)
    if (tl.load(bf + (T + 1) * H) | tl.load(bb + (T + 1) * H)) != 0:
        first, last = tl.load(bf + T * H), tl.load(bb + T * H)
        NB = tl.cdiv(T, BLOCK)
        # 1. from the end: whether a flagged token lies at or after t in t's segment (or
        # t's segment is the last and dh_T was flagged), kept in bit 1 of fb
        carry = last
        for i in range(NB):
            # the block's tokens from last to first: a forward scan over them is the
            # reverse scan (no reverse=True, whose lowering an order-sensitive combine
            # would have to trust)
            o_t = (NB - 1 - i) * BLOCK + (BLOCK - 1 - o_i)
            m_t = o_t < T
            own = tl.load(bb + o_t * H, mask=m_t, other=0)
            bad = own | tl.load(bf + o_t * H, mask=m_t, other=0)
            # t ends a segment when t + 1 starts one
            cut = _cuts(g, r, i_b, i_h, o_t + 1, o_t + 1 < T, T, H, HAS_G, HAS_R)
            rr, vv = tl.associative_scan((cut, bad), 0, _set_reset)
            sf = vv | (carry & (rr == 0).to(tl.int32))
            carry = _at(sf, o_i, BLOCK - 1)  # the block's first token
            tl.store(bb + o_t * H, own | (sf << 1), mask=m_t)
        tl.debug_barrier()
        # 2. from the start: at or before t (or the first segment and h0 flagged); a
        # token is poisoned when either holds
        carry = first
        seg0 = first | last  # T = 0: the one (empty) segment is both
        for i0 in range(0, T, BLOCK):
            o_t = i0 + o_i
            m_t = o_t < T
            both = tl.load(bb + o_t * H, mask=m_t, other=0)
            bad = (both & 1) | tl.load(bf + o_t * H, mask=m_t, other=0)
            cut = _cuts(g, r, i_b, i_h, o_t, m_t, T, H, HAS_G, HAS_R)
            rr, vv = tl.associative_scan((cut, bad), 0, _set_reset)
            pf = vv | (carry & (rr == 0).to(tl.int32))
            carry = _at(pf, o_i, BLOCK - 1)
            seg = pf | (both >> 1)
            seg0 = tl.where(i0 == 0, _at(seg, o_i, 0), seg0)
            m = m_t & (seg != 0)
            for j in tl.static_range(G):
                _nan_rows(dq, ((i_b * T + o_t) * (H * G) + i_h * G + j) * K, m, K, BD)
            _nan_rows(dk, ((i_b * T + o_t) * H + i_h) * K, m, K, BD)
            _nan_rows(dv, ((i_b * T + o_t) * H + i_h) * V, m, V, BD)
            if HAS_G:
                nan = tl.full([BLOCK], float("nan"), tl.float32)
                tl.store(dg + (i_b * T + o_t) * H + i_h, nan, mask=m)
        if HAS_INIT:
            _nan_state(dh0, i_bh, K * V, seg0, BD * BD)

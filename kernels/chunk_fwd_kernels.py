"""Forward Triton kernels of the primitive (chunk_state -> state_passing -> chunk output).

The algebra is that of :mod:`hla_sp.kernels.chunk`, whose launchers call these
kernels; the masks D, ws, wc and the pass factor p come from the one helper
:func:`hla_sp.kernels._decay.in_chunk_decay` (stable segment sums).
"""

from __future__ import annotations

import triton.language as tl

from ._decay import in_chunk_decay
from ._jit import lazy_jit
from ._round import finite, operand, round_to


@lazy_jit
def chunk_state_kernel(
    x,  # [B, T, H, DX]
    y,  # [B, T, H, DY]
    g,  # [B, T, H] fp32 log-decay (HAS_G)
    r,  # [B, T] int32 document starts (HAS_R)
    out,  # [B, H, N, DX, DY] fp32
    T,
    H,
    DX,
    DY,
    N,
    G: tl.constexpr,  # query heads per kv head: g has H / G heads (CARRY over a group's queries)
    BT: tl.constexpr,
    BX: tl.constexpr,
    BY: tl.constexpr,
    CARRY: tl.constexpr,  # False: out = (x*ws)^T y (chunk state); True: (x*wc)^T y
    HAS_G: tl.constexpr,
    HAS_R: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Per chunk, one [BX, BY] block of a weighted x^T y.

    CARRY=False: the chunk's state from zero, s_n = (k * ws)^T v.
    CARRY=True: the chunk's gradient to its incoming state, u_n = (q * wc)^T do.
    """
    i_n, i_xy, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NY = tl.cdiv(DY, BY)
    i_x, i_y = i_xy // NY, i_xy % NY
    i_bh = i_bh.to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_i = tl.arange(0, BT)
    o_t = i_n * BT + o_i  # int32 is enough: T < 2^31; products with i_b are int64
    m_t = o_t < T
    o_x = i_x * BX + tl.arange(0, BX)
    o_y = i_y * BY + tl.arange(0, BY)
    m_x, m_y = o_x < DX, o_y < DY
    # CARRY: the incoming state's weight wc; else the chunk state's weight ws
    b_wc, b_ws, _, _ = in_chunk_decay(g, r, i_b, i_h // G, o_t, T, H // G, BT, HAS_G, HAS_R)
    if CARRY:
        b_w = b_wc
    else:
        b_w = b_ws
    # p_x: [BT, BX], p_y: [BT, BY]
    p_x = x + ((i_b * T + o_t[:, None]) * H + i_h) * DX + o_x[None, :]
    p_y = y + ((i_b * T + o_t[:, None]) * H + i_h) * DY + o_y[None, :]
    b_x = tl.load(p_x, mask=m_t[:, None] & m_x[None, :], other=0.0)
    b_y = tl.load(p_y, mask=m_t[:, None] & m_y[None, :], other=0.0)
    if UPCAST:
        b_x, b_y = b_x.to(tl.float32), b_y.to(tl.float32)
    b_x, b_y = finite(b_x), finite(b_y)  # a zero weight times NaN is still NaN
    b_xw = operand(b_x * b_w[:, None], x.dtype.element_ty, UPCAST)  # [BT, BX]
    b_s = tl.dot(tl.trans(b_xw), b_y, input_precision=DOT_PREC)  # [BX, BY]
    p_s = out + ((i_bh * N + i_n) * DX + o_x[:, None]) * DY + o_y[None, :]
    tl.store(p_s, b_s, mask=m_x[:, None] & m_y[None, :])


@lazy_jit
def state_passing_kernel(
    hs,  # [B, H, N, DX, DY] fp32: chunk summands in, states out (in place)
    g,  # [B, T, H] fp32 (HAS_G)
    r,  # [B, T] int32 (HAS_R)
    h_init,  # [B, H, DX, DY] fp32 (HAS_INIT)
    h_last,  # [B, H, DX, DY] fp32 (STORE_LAST)
    T,
    H,
    DX,
    DY,
    N,
    BT: tl.constexpr,
    BX: tl.constexpr,
    BY: tl.constexpr,
    REVERSE: tl.constexpr,
    HAS_G: tl.constexpr,
    HAS_R: tl.constexpr,
    HAS_INIT: tl.constexpr,
    STORE_LAST: tl.constexpr,
):
    """The sequential pass over chunks, in place, for one [BX, BY] block of the state.

    Forward (REVERSE=False): h = h_init; for n = 0..N-1: hs[n], h = h, p_n h + hs[n].
    Afterwards hs[n] is the state entering chunk n and h_last the final state.
    Reverse (REVERSE=True), for the state gradients: h = h_init (= dh_T); for
    n = N-1..0: hs[n], h = h, hs[n] + p_n h. Afterwards hs[n] is the gradient of the
    state leaving chunk n and h_last = dh0.
    """
    i_xy, i_bh = tl.program_id(0), tl.program_id(1)
    NY = tl.cdiv(DY, BY)
    i_x, i_y = i_xy // NY, i_xy % NY
    i_bh = i_bh.to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_i = tl.arange(0, BT)
    o_x = i_x * BX + tl.arange(0, BX)
    o_y = i_y * BY + tl.arange(0, BY)
    m_xy = (o_x[:, None] < DX) & (o_y[None, :] < DY)
    o_xy = o_x[:, None] * DY + o_y[None, :]  # [BX, BY] offsets inside one state
    if HAS_INIT:
        b_h = finite(tl.load(h_init + i_bh * DX * DY + o_xy, mask=m_xy, other=0.0))
    else:
        b_h = tl.zeros([BX, BY], dtype=tl.float32)
    for i in range(N):
        if REVERSE:
            i_n = N - 1 - i
        else:
            i_n = i
        o_t = i_n * BT + o_i  # int32 is enough: T < 2^31; products with i_b are int64
        # p_n: exp of the chunk's total decay, 0 if the chunk contains a start
        _, _, b_p, _ = in_chunk_decay(g, r, i_b, i_h, o_t, T, H, BT, HAS_G, HAS_R)
        p_s = hs + (i_bh * N + i_n) * DX * DY + o_xy
        b_s = tl.load(p_s, mask=m_xy, other=0.0)
        tl.store(p_s, b_h, mask=m_xy)
        b_h = b_p * b_h + b_s
    if STORE_LAST:
        tl.store(h_last + i_bh * DX * DY + o_xy, b_h, mask=m_xy)


@lazy_jit
def chunk_fwd_o_kernel(
    q,  # [B, T, H, K]
    k,  # [B, T, H, K]
    v,  # [B, T, H, V]
    hs,  # [B, H, N, K, V] fp32 states entering each chunk
    g,  # [B, T, H] fp32 (HAS_G)
    r,  # [B, T] int32 (HAS_R)
    o,  # [B, T, H, V]
    T,
    H,
    K,
    V,
    N,
    # multi-query: q, o have H heads, k, v, hs, g H / G; head h reads kv head h / G. A
    # constexpr: G = 1 compiles to the code without groups (no spill added, AOT gate)
    G: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_G: tl.constexpr,
    HAS_R: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Outputs of one chunk, one [BT, BV] block: ((q k^T) * D) v + wc * (q h_in)."""
    i_n, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_bh = i_bh.to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    # the kv heads, and the one this query head reads; its states are (b, kv head)
    # i_bh // G, written so that G = 1 folds to the code without groups
    HK, i_kh = H // G, i_h // G
    o_i = tl.arange(0, BT)
    o_t = i_n * BT + o_i  # int32 is enough: T < 2^31; products with i_b are int64
    m_t = o_t < T
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_wc, _, _, b_D = in_chunk_decay(g, r, i_b, i_kh, o_t, T, HK, BT, HAS_G, HAS_R)

    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        p_q = ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :]  # [BT, BK]
        p_k = ((i_b * T + o_t[:, None]) * HK + i_kh) * K + o_k[None, :]
        b_q = tl.load(q + p_q, mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_k = tl.load(k + p_k, mask=m_t[:, None] & m_k[None, :], other=0.0)
        p_h = hs + (((i_bh // G) * N + i_n) * K + o_k[:, None]) * V + o_v[None, :]
        b_h = tl.load(p_h, mask=m_k[:, None] & m_v[None, :], other=0.0)
        if UPCAST:
            b_q, b_k = b_q.to(tl.float32), b_k.to(tl.float32)
        # q stays as it is: a non-finite q_t reaches its own row, o_t, only
        b_k = finite(b_k)
        b_A += tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
        b_h = operand(b_h, q.dtype.element_ty, UPCAST)
        b_o += tl.dot(b_q, b_h, input_precision=DOT_PREC)
    p_v = ((i_b * T + o_t[:, None]) * HK + i_kh) * V + o_v[None, :]  # [BT, BV]
    b_v = tl.load(v + p_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
    if UPCAST:
        b_v = b_v.to(tl.float32)
    b_v = finite(b_v)
    b_AD = operand(b_A * b_D, q.dtype.element_ty, UPCAST)
    b_o = b_o * b_wc[:, None] + tl.dot(b_AD, b_v, input_precision=DOT_PREC)
    p_o = ((i_b * T + o_t[:, None]) * H + i_h) * V + o_v[None, :]
    tl.store(o + p_o, round_to(b_o, o.dtype.element_ty, UPCAST), mask=m_t[:, None] & m_v[None, :])

"""Triton kernels of the fused second-order HLA (k~ = S q kept on chip).

The forms and the recurrences they compute are described in
:mod:`hla_sp.kernels.hla2_fused`, whose launchers call these kernels.
"""

from __future__ import annotations

import triton.language as tl

from ._decay import in_chunk_decay
from ._jit import lazy_jit
from ._round import finite, operand, round_to


@lazy_jit
def fused_hla2_fwd_kernel(
    q,  # [B, T, H, K]
    k,  # [B, T, H, K]
    v,  # [B, T, H, V]
    g,  # [B, T, H] fp32 (HAS_G)
    r,  # [B, T] int32 (HAS_R)
    S0,  # [B, H, K, K] fp32 (HAS_S0)
    H0,  # [B, H, K, V] fp32 (HAS_H0)
    o,  # [B, T, H, V]
    S_T,  # [B, H, K, K] fp32
    H_T,  # [B, H, K, V] fp32
    ridge,  # float
    T,
    H,
    K,
    V,
    N,
    BT: tl.constexpr,
    BK: tl.constexpr,  # >= K: the whole key dimension
    BV: tl.constexpr,
    HAS_G: tl.constexpr,
    HAS_R: tl.constexpr,
    HAS_S0: tl.constexpr,
    HAS_H0: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One (batch, head, V block): all chunks in order, S and H on chip."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_bh = i_bh.to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_i = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kk = m_k[:, None] & m_k[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    # b_S: [BK, BK], b_H: [BK, BV], both fp32
    if HAS_S0:
        b_S = finite(tl.load(S0 + (i_bh * K + o_k[:, None]) * K + o_k[None, :], mask=m_kk,
                                   other=0.0))
    else:
        b_S = tl.zeros([BK, BK], dtype=tl.float32)
    if HAS_H0:
        b_H = finite(tl.load(H0 + (i_bh * K + o_k[:, None]) * V + o_v[None, :], mask=m_kv,
                                   other=0.0))
    else:
        b_H = tl.zeros([BK, BV], dtype=tl.float32)
    for i_n in range(N):
        o_t = i_n * BT + o_i
        m_t = o_t < T
        b_wc, b_ws, b_p, b_D = in_chunk_decay(g, r, i_b, i_h, o_t, T, H, BT, HAS_G, HAS_R)

        p_qk = ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :]  # [BT, BK]
        b_q = tl.load(q + p_qk, mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_k = tl.load(k + p_qk, mask=m_t[:, None] & m_k[None, :], other=0.0)
        p_v = ((i_b * T + o_t[:, None]) * H + i_h) * V + o_v[None, :]  # [BT, BV]
        b_v = tl.load(v + p_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
        if UPCAST:
            b_q, b_k, b_v = b_q.to(tl.float32), b_k.to(tl.float32), b_v.to(tl.float32)
        b_q, b_k, b_v = finite(b_q), finite(b_k), finite(b_v)
        # stage 1: k~ [BT, BK] in fp32, kept on chip
        b_A = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * b_D
        b_kt = tl.dot(operand(b_A, q.dtype.element_ty, UPCAST), b_k, input_precision=DOT_PREC)
        b_qS = tl.dot(b_q, operand(b_S, q.dtype.element_ty, UPCAST), input_precision=DOT_PREC)
        b_kt = b_kt + b_wc[:, None] * b_qS + ridge * b_q.to(tl.float32)
        b_ktd = operand(b_kt, q.dtype.element_ty, UPCAST)  # dot operand
        # stage 2: o [BT, BV]
        b_B = tl.dot(b_q, tl.trans(b_ktd), input_precision=DOT_PREC) * b_D
        b_o = tl.dot(operand(b_B, q.dtype.element_ty, UPCAST), b_v, input_precision=DOT_PREC)
        b_qH = tl.dot(b_q, operand(b_H, q.dtype.element_ty, UPCAST), input_precision=DOT_PREC)
        b_o += b_wc[:, None] * b_qH
        tl.store(o + p_v, round_to(b_o, o.dtype.element_ty, UPCAST),
                 mask=m_t[:, None] & m_v[None, :])
        # the states leaving the chunk
        b_kw = operand(b_k * b_ws[:, None], q.dtype.element_ty, UPCAST)
        b_S = b_p * b_S + tl.dot(tl.trans(b_kw), b_k, input_precision=DOT_PREC)
        b_ktw = operand(b_kt * b_ws[:, None], q.dtype.element_ty, UPCAST)
        b_H = b_p * b_H + tl.dot(tl.trans(b_ktw), b_v, input_precision=DOT_PREC)
    tl.store(H_T + (i_bh * K + o_k[:, None]) * V + o_v[None, :], b_H, mask=m_kv)
    if i_v == 0:
        tl.store(S_T + (i_bh * K + o_k[:, None]) * K + o_k[None, :], b_S, mask=m_kk)


@lazy_jit
def hla2_state_kernel(
    q,  # [B, T, H, K]
    k,  # [B, T, H, K]
    v,  # [B, T, H, V]
    Ss,  # [B, H, N, K, K] fp32: stage-1 state entering each chunk
    g,  # [B, T, H] fp32 (HAS_G)
    r,  # [B, T] int32 (HAS_R)
    hs,  # [B, H, N, K, V] fp32 out: stage-2 chunk states from zero
    ridge,  # float
    T,
    H,
    K,
    V,
    N,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_G: tl.constexpr,
    HAS_R: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Stage-2 state of one chunk, block [BK (x), BV]: (k~[:, x] * ws)^T v, k~ on chip."""
    i_n, i_xv, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NV = tl.cdiv(V, BV)
    i_x, i_v = i_xv // NV, i_xv % NV
    i_bh = i_bh.to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_i = tl.arange(0, BT)
    o_t = i_n * BT + o_i
    m_t = o_t < T
    o_x = i_x * BK + tl.arange(0, BK)
    m_x = o_x < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_wc, b_ws, _, b_D = in_chunk_decay(g, r, i_b, i_h, o_t, T, H, BT, HAS_G, HAS_R)

    # b_A: (q k^T) over all of K; b_qS: (q S_in)[:, x]
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    b_qS = tl.zeros([BT, BK], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        p_qk = ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :]  # [BT, BK]
        b_q = tl.load(q + p_qk, mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_k = tl.load(k + p_qk, mask=m_t[:, None] & m_k[None, :], other=0.0)
        p_S = Ss + ((i_bh * N + i_n) * K + o_k[:, None]) * K + o_x[None, :]  # [BK, BK]
        b_S = tl.load(p_S, mask=m_k[:, None] & m_x[None, :], other=0.0)
        if UPCAST:
            b_q, b_k = b_q.to(tl.float32), b_k.to(tl.float32)
        b_q, b_k = finite(b_q), finite(b_k)
        b_A += tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
        b_qS += tl.dot(b_q, operand(b_S, q.dtype.element_ty, UPCAST), input_precision=DOT_PREC)
    p_x = ((i_b * T + o_t[:, None]) * H + i_h) * K + o_x[None, :]  # [BT, BK]
    b_qx = tl.load(q + p_x, mask=m_t[:, None] & m_x[None, :], other=0.0)
    b_kx = tl.load(k + p_x, mask=m_t[:, None] & m_x[None, :], other=0.0)
    p_v = ((i_b * T + o_t[:, None]) * H + i_h) * V + o_v[None, :]  # [BT, BV]
    b_v = tl.load(v + p_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
    if UPCAST:
        b_qx, b_kx, b_v = b_qx.to(tl.float32), b_kx.to(tl.float32), b_v.to(tl.float32)
    b_qx, b_kx, b_v = finite(b_qx), finite(b_kx), finite(b_v)
    b_AD = operand(b_A * b_D, q.dtype.element_ty, UPCAST)
    b_kt = tl.dot(b_AD, b_kx, input_precision=DOT_PREC) + b_wc[:, None] * b_qS
    b_kt += ridge * b_qx.to(tl.float32)  # k~[:, x], [BT, BK] fp32
    b_ktw = operand(b_kt * b_ws[:, None], q.dtype.element_ty, UPCAST)
    b_s = tl.dot(tl.trans(b_ktw), b_v, input_precision=DOT_PREC)  # [BK, BV]
    p_s = hs + ((i_bh * N + i_n) * K + o_x[:, None]) * V + o_v[None, :]
    tl.store(p_s, b_s, mask=m_x[:, None] & m_v[None, :])


@lazy_jit
def hla2_fwd_o_kernel(
    q,  # [B, T, H, K]
    k,  # [B, T, H, K]
    v,  # [B, T, H, V]
    Ss,  # [B, H, N, K, K] fp32: stage-1 state entering each chunk
    hs,  # [B, H, N, K, V] fp32: stage-2 state entering each chunk
    g,  # [B, T, H] fp32 (HAS_G)
    r,  # [B, T] int32 (HAS_R)
    o,  # [B, T, H, V] fp32
    ridge,  # float
    T,
    H,
    K,
    V,
    N,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_G: tl.constexpr,
    HAS_R: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Outputs of one chunk, block [BT, BV]: ((q k~^T) * D) v + wc * (q H_in), k~ on chip."""
    i_n, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_bh = i_bh.to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_i = tl.arange(0, BT)
    o_t = i_n * BT + o_i
    m_t = o_t < T
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_wc, _, _, b_D = in_chunk_decay(g, r, i_b, i_h, o_t, T, H, BT, HAS_G, HAS_R)

    NK = tl.cdiv(K, BK)
    b_A = tl.zeros([BT, BT], dtype=tl.float32)  # q k^T
    for i_k in range(NK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        p_qk = ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :]
        b_q = tl.load(q + p_qk, mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_k = tl.load(k + p_qk, mask=m_t[:, None] & m_k[None, :], other=0.0)
        if UPCAST:
            b_q, b_k = b_q.to(tl.float32), b_k.to(tl.float32)
        b_q, b_k = finite(b_q), finite(b_k)
        b_A += tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
    b_AD = operand(b_A * b_D, q.dtype.element_ty, UPCAST)  # [BT, BT] dot operand

    b_Bm = tl.zeros([BT, BT], dtype=tl.float32)  # q k~^T
    b_o = tl.zeros([BT, BV], dtype=tl.float32)  # q H_in
    for i_x in range(NK):
        o_x = i_x * BK + tl.arange(0, BK)
        m_x = o_x < K
        p_x = ((i_b * T + o_t[:, None]) * H + i_h) * K + o_x[None, :]
        b_qx = tl.load(q + p_x, mask=m_t[:, None] & m_x[None, :], other=0.0)
        b_kx = tl.load(k + p_x, mask=m_t[:, None] & m_x[None, :], other=0.0)
        if UPCAST:
            b_qx, b_kx = b_qx.to(tl.float32), b_kx.to(tl.float32)
        b_qx, b_kx = finite(b_qx), finite(b_kx)
        # k~[:, x] = ((q k^T) * D) k[:, x] + wc * (q S_in)[:, x] + ridge q[:, x]
        b_qS = tl.zeros([BT, BK], dtype=tl.float32)
        for i_k in range(NK):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            p_qk = ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :]
            b_q = tl.load(q + p_qk, mask=m_t[:, None] & m_k[None, :], other=0.0)
            if UPCAST:
                b_q = b_q.to(tl.float32)
            b_q = finite(b_q)
            p_S = Ss + ((i_bh * N + i_n) * K + o_k[:, None]) * K + o_x[None, :]
            b_S = tl.load(p_S, mask=m_k[:, None] & m_x[None, :], other=0.0)
            b_S = operand(b_S, q.dtype.element_ty, UPCAST)
            b_qS += tl.dot(b_q, b_S, input_precision=DOT_PREC)
        b_kt = tl.dot(b_AD, b_kx, input_precision=DOT_PREC)
        b_kt += b_wc[:, None] * b_qS + ridge * b_qx.to(tl.float32)
        b_ktd = operand(b_kt, q.dtype.element_ty, UPCAST)
        b_Bm += tl.dot(b_qx, tl.trans(b_ktd), input_precision=DOT_PREC)
        p_h = hs + ((i_bh * N + i_n) * K + o_x[:, None]) * V + o_v[None, :]  # [BK, BV]
        b_h = tl.load(p_h, mask=m_x[:, None] & m_v[None, :], other=0.0)
        b_o += tl.dot(b_qx, operand(b_h, q.dtype.element_ty, UPCAST), input_precision=DOT_PREC)
    p_v = ((i_b * T + o_t[:, None]) * H + i_h) * V + o_v[None, :]
    b_v = tl.load(v + p_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
    if UPCAST:
        b_v = b_v.to(tl.float32)
    b_v = finite(b_v)
    b_BD = operand(b_Bm * b_D, q.dtype.element_ty, UPCAST)
    b_o = b_o * b_wc[:, None] + tl.dot(b_BD, b_v, input_precision=DOT_PREC)
    tl.store(o + p_v, round_to(b_o, o.dtype.element_ty, UPCAST), mask=m_t[:, None] & m_v[None, :])


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

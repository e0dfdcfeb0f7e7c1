"""Triton kernels of the primitive: chunked decayed causal linear attention.

    h_t = exp(g_t) h_{t-1} + k_t v_t^T   (K x V, fp32),   o_t = q_t^T h_t

The work is split as in fla and mamba (chunk_state -> state_passing -> chunk_scan):

1. :func:`chunk_state_kernel`    per chunk n, from a zero state: s_n = sum_j ws_j k_j v_j^T
2. :func:`state_passing_kernel`  sequential over chunks: h_in[n] = h, h = p_n h + s_n
3. :func:`chunk_fwd_o_kernel`    per chunk: o = ((q k^T) * D) v + wc * (q h_in[n])

With b the within-chunk cumulative log-decay and c the number of document starts
(``resets``) seen so far in the chunk:

    D[t, j] = exp(b_t - b_j) [j <= t] [c_t == c_j]     pair weight inside a chunk
    ws_j    = exp(b_C - b_j) [c_j == c_C]              weight of token j in the chunk state
    wc_t    = exp(b_t) [c_t == 0]                       weight of the incoming state
    p_n     = exp(b_C) [c_C == 0]                       pass factor of chunk n

exactly as in :mod:`hla_sp.ops.chunk`. The backward mirrors it: the states are
recomputed (1, 2) instead of being saved by the forward, the state gradients run the
same passing in reverse, and two per-chunk kernels give dq, dk (with the per-token dA)
and dv. With A = cumsum(g), every term of the output and of the final state has the form
exp(A_dest - A_src) * (...), so

    dA_t = q_t . dq_t - k_t . dk_t  (+ <dh_T, h_T> at the last token)
    dg_t = sum_{s >= t} dA_s        (a reverse cumsum, :func:`reverse_cumsum_kernel`)

The h0 terms need nothing extra: exp(A_t) q_t^T h0 is inside q_t . dq_t, and
exp(A_T) h0 is inside <dh_T, h_T>.

Every offset is int64 (B*T*H*K passes 2^31 at a million tokens), and the chunk index
is on grid axis 0, which CUDA allows up to 2^31 - 1 (axes 1 and 2, holding the K/V
blocks and B*H, stop at 65535; at 64 tokens a chunk that would be 4M tokens). States and
accumulators are fp32; fp16/bf16 operands are fed to ``tl.dot`` in their own dtype
with fp32 accumulation, as fla does. fp32 inputs use IEEE fp32 dots unless
``torch.get_float32_matmul_precision()`` allows TF32, mirroring torch's own matmul.
fp64 inputs are rejected: the dispatcher sends them to the PyTorch path, which
computes in fp64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import interpreting, lazy_jit

MIN_CHUNK = 16  # tl.dot needs every dimension >= 16
MAX_CHUNK = 64  # larger tiles only add register pressure


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
    # b_b: [BT] within-chunk cumulative log-decay; b_bC: the chunk's total
    if HAS_G:
        b_g = tl.load(g + (i_b * T + o_t) * H + i_h, mask=m_t, other=0.0)
        b_b = tl.cumsum(b_g, 0)
    else:
        b_b = tl.zeros([BT], dtype=tl.float32)
    b_bC = tl.sum(tl.where(o_i == BT - 1, b_b, 0.0), 0)
    if CARRY:
        b_w = tl.exp(b_b)
    else:
        b_w = tl.exp(b_bC - b_b)
    if HAS_R:
        b_c = tl.cumsum(tl.load(r + i_b * T + o_t, mask=m_t, other=0), 0)
        b_cC = tl.sum(tl.where(o_i == BT - 1, b_c, 0), 0)
        if CARRY:
            b_w = tl.where(b_c == 0, b_w, 0.0)
        else:
            b_w = tl.where(b_c == b_cC, b_w, 0.0)
    # p_x: [BT, BX], p_y: [BT, BY]
    p_x = x + ((i_b * T + o_t[:, None]) * H + i_h) * DX + o_x[None, :]
    p_y = y + ((i_b * T + o_t[:, None]) * H + i_h) * DY + o_y[None, :]
    b_x = tl.load(p_x, mask=m_t[:, None] & m_x[None, :], other=0.0)
    b_y = tl.load(p_y, mask=m_t[:, None] & m_y[None, :], other=0.0)
    if UPCAST:
        b_x, b_y = b_x.to(tl.float32), b_y.to(tl.float32)
    b_xw = (b_x * b_w[:, None]).to(x.dtype.element_ty).to(b_y.dtype)  # [BT, BX]
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
        b_h = tl.load(h_init + i_bh * DX * DY + o_xy, mask=m_xy, other=0.0)
    else:
        b_h = tl.zeros([BX, BY], dtype=tl.float32)
    for i in range(N):
        if REVERSE:
            i_n = N - 1 - i
        else:
            i_n = i
        o_t = i_n * BT + o_i  # int32 is enough: T < 2^31; products with i_b are int64
        m_t = o_t < T
        # p_n: exp of the chunk's total decay, 0 if the chunk contains a start
        if HAS_G:
            b_p = tl.exp(tl.sum(tl.load(g + (i_b * T + o_t) * H + i_h, mask=m_t, other=0.0), 0))
        else:
            b_p = 1.0
        if HAS_R:
            n_starts = tl.sum(tl.load(r + i_b * T + o_t, mask=m_t, other=0), 0)
            b_p = tl.where(n_starts == 0, b_p, 0.0)
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
    o_i = tl.arange(0, BT)
    o_t = i_n * BT + o_i  # int32 is enough: T < 2^31; products with i_b are int64
    m_t = o_t < T
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_causal = o_i[:, None] >= o_i[None, :]
    if HAS_G:
        b_b = tl.cumsum(tl.load(g + (i_b * T + o_t) * H + i_h, mask=m_t, other=0.0), 0)
    else:
        b_b = tl.zeros([BT], dtype=tl.float32)
    b_wc = tl.exp(b_b)  # [BT]
    m_D = m_causal
    if HAS_R:
        b_c = tl.cumsum(tl.load(r + i_b * T + o_t, mask=m_t, other=0), 0)
        b_wc = tl.where(b_c == 0, b_wc, 0.0)
        m_D = m_D & (b_c[:, None] == b_c[None, :])
    # b_D: [BT, BT]; exp only of masked-in (non-positive) differences
    b_D = tl.exp(tl.where(m_D, b_b[:, None] - b_b[None, :], float("-inf")))

    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        p_qk = ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :]  # [BT, BK]
        b_q = tl.load(q + p_qk, mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_k = tl.load(k + p_qk, mask=m_t[:, None] & m_k[None, :], other=0.0)
        p_h = hs + ((i_bh * N + i_n) * K + o_k[:, None]) * V + o_v[None, :]  # [BK, BV]
        b_h = tl.load(p_h, mask=m_k[:, None] & m_v[None, :], other=0.0)
        if UPCAST:
            b_q, b_k = b_q.to(tl.float32), b_k.to(tl.float32)
        b_A += tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
        b_h = b_h.to(q.dtype.element_ty).to(b_q.dtype)
        b_o += tl.dot(b_q, b_h, input_precision=DOT_PREC)
    p_v = ((i_b * T + o_t[:, None]) * H + i_h) * V + o_v[None, :]  # [BT, BV]
    b_v = tl.load(v + p_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
    if UPCAST:
        b_v = b_v.to(tl.float32)
    b_AD = (b_A * b_D).to(q.dtype.element_ty).to(b_v.dtype)
    b_o = b_o * b_wc[:, None] + tl.dot(b_AD, b_v, input_precision=DOT_PREC)
    tl.store(o + p_v, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


@lazy_jit
def chunk_bwd_dv_kernel(
    q,  # [B, T, H, K]
    k,  # [B, T, H, K]
    do,  # [B, T, H, V]
    dhs,  # [B, H, N, K, V] fp32: gradient of the state leaving each chunk
    g,  # [B, T, H] fp32 (HAS_G)
    r,  # [B, T] int32 (HAS_R)
    dv,  # [B, T, H, V]
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
    """dv_j = sum_t D[t, j] (q_t . k_j) do_t + ws_j (k_j^T dh_n), one [BT, BV] block."""
    i_n, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_bh = i_bh.to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_i = tl.arange(0, BT)
    o_t = i_n * BT + o_i  # int32 is enough: T < 2^31; products with i_b are int64
    m_t = o_t < T
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    # transposed mask: row j (key), column t (query)
    m_Dt = o_i[:, None] <= o_i[None, :]
    if HAS_G:
        b_b = tl.cumsum(tl.load(g + (i_b * T + o_t) * H + i_h, mask=m_t, other=0.0), 0)
    else:
        b_b = tl.zeros([BT], dtype=tl.float32)
    b_bC = tl.sum(tl.where(o_i == BT - 1, b_b, 0.0), 0)
    b_ws = tl.exp(b_bC - b_b)
    if HAS_R:
        b_c = tl.cumsum(tl.load(r + i_b * T + o_t, mask=m_t, other=0), 0)
        b_cC = tl.sum(tl.where(o_i == BT - 1, b_c, 0), 0)
        b_ws = tl.where(b_c == b_cC, b_ws, 0.0)
        m_Dt = m_Dt & (b_c[:, None] == b_c[None, :])
    b_Dt = tl.exp(tl.where(m_Dt, b_b[None, :] - b_b[:, None], float("-inf")))  # [BT(j), BT(t)]

    b_At = tl.zeros([BT, BT], dtype=tl.float32)  # (k_j . q_t)
    b_dv = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        p_qk = ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :]
        b_q = tl.load(q + p_qk, mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_k = tl.load(k + p_qk, mask=m_t[:, None] & m_k[None, :], other=0.0)
        p_dh = dhs + ((i_bh * N + i_n) * K + o_k[:, None]) * V + o_v[None, :]  # [BK, BV]
        b_dh = tl.load(p_dh, mask=m_k[:, None] & m_v[None, :], other=0.0)
        if UPCAST:
            b_q, b_k = b_q.to(tl.float32), b_k.to(tl.float32)
        b_At += tl.dot(b_k, tl.trans(b_q), input_precision=DOT_PREC)
        b_dh = b_dh.to(q.dtype.element_ty).to(b_k.dtype)
        b_dv += tl.dot(b_k, b_dh, input_precision=DOT_PREC)
    p_v = ((i_b * T + o_t[:, None]) * H + i_h) * V + o_v[None, :]
    b_do = tl.load(do + p_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
    if UPCAST:
        b_do = b_do.to(tl.float32)
    b_AD = (b_At * b_Dt).to(q.dtype.element_ty).to(b_do.dtype)
    b_dv = b_dv * b_ws[:, None] + tl.dot(b_AD, b_do, input_precision=DOT_PREC)
    tl.store(dv + p_v, b_dv.to(dv.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


@lazy_jit
def chunk_bwd_dqk_kernel(
    q,  # [B, T, H, K]
    k,  # [B, T, H, K]
    v,  # [B, T, H, V]
    do,  # [B, T, H, V]
    hs,  # [B, H, N, K, V] fp32 states entering each chunk
    dhs,  # [B, H, N, K, V] fp32 gradients of the states leaving each chunk
    g,  # [B, T, H] fp32 (HAS_G)
    r,  # [B, T] int32 (HAS_R)
    dq,  # [B, T, H, K]
    dk,  # [B, T, H, K]
    dA,  # [NK, B, T, H] fp32 per-token q.dq - k.dk of this K block (HAS_G)
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
    """dq, dk of one chunk and one K block, and that block's share of dA.

    dq_t = sum_j D[t, j] (do_t . v_j) k_j + wc_t (h_in do_t)
    dk_j = sum_t D[t, j] (do_t . v_j) q_t + ws_j (dh_n v_j)
    """
    i_n, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_bh = i_bh.to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_i = tl.arange(0, BT)
    o_t = i_n * BT + o_i  # int32 is enough: T < 2^31; products with i_b are int64
    m_t = o_t < T
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_D = o_i[:, None] >= o_i[None, :]
    if HAS_G:
        b_b = tl.cumsum(tl.load(g + (i_b * T + o_t) * H + i_h, mask=m_t, other=0.0), 0)
    else:
        b_b = tl.zeros([BT], dtype=tl.float32)
    b_bC = tl.sum(tl.where(o_i == BT - 1, b_b, 0.0), 0)
    b_wc = tl.exp(b_b)
    b_ws = tl.exp(b_bC - b_b)
    if HAS_R:
        b_c = tl.cumsum(tl.load(r + i_b * T + o_t, mask=m_t, other=0), 0)
        b_cC = tl.sum(tl.where(o_i == BT - 1, b_c, 0), 0)
        b_wc = tl.where(b_c == 0, b_wc, 0.0)
        b_ws = tl.where(b_c == b_cC, b_ws, 0.0)
        m_D = m_D & (b_c[:, None] == b_c[None, :])
    b_D = tl.exp(tl.where(m_D, b_b[:, None] - b_b[None, :], float("-inf")))  # [BT, BT]

    b_dP = tl.zeros([BT, BT], dtype=tl.float32)  # (do_t . v_j)
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        p_v = ((i_b * T + o_t[:, None]) * H + i_h) * V + o_v[None, :]  # [BT, BV]
        b_v = tl.load(v + p_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_do = tl.load(do + p_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
        p_h = ((i_bh * N + i_n) * K + o_k[:, None]) * V + o_v[None, :]  # [BK, BV]
        b_h = tl.load(hs + p_h, mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_dh = tl.load(dhs + p_h, mask=m_k[:, None] & m_v[None, :], other=0.0)
        if UPCAST:
            b_v, b_do = b_v.to(tl.float32), b_do.to(tl.float32)
        b_h = b_h.to(q.dtype.element_ty).to(b_do.dtype)
        b_dh = b_dh.to(q.dtype.element_ty).to(b_v.dtype)
        b_dP += tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)
        b_dq += tl.dot(b_do, tl.trans(b_h), input_precision=DOT_PREC)
        b_dk += tl.dot(b_v, tl.trans(b_dh), input_precision=DOT_PREC)
    p_qk = ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :]  # [BT, BK]
    m_qk = m_t[:, None] & m_k[None, :]
    b_q = tl.load(q + p_qk, mask=m_qk, other=0.0)
    b_k = tl.load(k + p_qk, mask=m_qk, other=0.0)
    if UPCAST:
        b_q, b_k = b_q.to(tl.float32), b_k.to(tl.float32)
    b_dP = (b_dP * b_D).to(q.dtype.element_ty).to(b_q.dtype)
    b_dq = b_dq * b_wc[:, None] + tl.dot(b_dP, b_k, input_precision=DOT_PREC)
    b_dk = b_dk * b_ws[:, None] + tl.dot(tl.trans(b_dP), b_q, input_precision=DOT_PREC)
    tl.store(dq + p_qk, b_dq.to(dq.dtype.element_ty), mask=m_qk)
    tl.store(dk + p_qk, b_dk.to(dk.dtype.element_ty), mask=m_qk)
    if HAS_G:
        # this K block's part of dA_t = q_t . dq_t - k_t . dk_t, from the fp32 values
        b_dA = tl.sum(b_q.to(tl.float32) * b_dq - b_k.to(tl.float32) * b_dk, 1)  # [BT]
        n_b = tl.num_programs(2) // H  # B
        p_dA = dA + ((i_k * n_b + i_b) * T + o_t) * H + i_h
        tl.store(p_dA, b_dA, mask=m_t)


@lazy_jit
def reverse_cumsum_kernel(
    dA,  # [NK, B, T, H] fp32
    d_last,  # [B, H] fp32: <dh_T, h_T>, the last token's extra dA
    dg,  # [B, T, H]
    B,
    T,
    H,
    N,
    NK: tl.constexpr,
    BT: tl.constexpr,
):
    """dg_t = d_last + sum_{s >= t} sum_k dA[k, s], chunk by chunk from the end."""
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_i = tl.arange(0, BT)
    b_carry = tl.load(d_last + i_bh)
    for i in range(N):
        o_t = (N - 1 - i) * BT + o_i
        m_t = o_t < T
        b_dA = tl.zeros([BT], dtype=tl.float32)
        for i_k in range(NK):
            b_dA += tl.load(dA + ((i_k * B + i_b) * T + o_t) * H + i_h, mask=m_t, other=0.0)
        b_dg = tl.cumsum(b_dA, 0, reverse=True) + b_carry
        tl.store(dg + (i_b * T + o_t) * H + i_h, b_dg.to(dg.dtype.element_ty), mask=m_t)
        b_carry += tl.sum(b_dA, 0)


def _dot_precision(dtype: torch.dtype) -> str:
    """IEEE fp32 dots unless torch itself is allowed TF32 for fp32 matmuls."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def _upcast(dtype: torch.dtype) -> bool:
    """Under the interpreter, compute bf16 in fp32 with the roundings emulated.

    Triton's CPU interpreter holds bf16 as raw 16-bit integers: conversions are right,
    arithmetic and dots on them are not. The kernels then widen every bf16 load to
    fp32 and round each dot operand through bf16 and back, so the interpreter runs the
    same roundings as a GPU (truncating instead of rounding to nearest).
    """
    return dtype == torch.bfloat16 and interpreting()


BLOCK_CAP = 64  # largest K or V tile; tests lower it to 16 to exercise several blocks


def _block(d: int, cap: int | None = None) -> int:
    """A power-of-two tile covering d (at least 16 for tl.dot), at most the cap."""
    cap = BLOCK_CAP if cap is None else min(cap, BLOCK_CAP)
    return min(max(16, triton.next_power_of_2(d)), cap)


def chunk_tile(chunk_size: int) -> int:
    """The Triton chunk length for a requested ``chunk_size``.

    The result does not depend on the chunk length (up to rounding), so the kernels
    clamp it to [16, 64]: tl.dot needs 16, larger tiles only cost registers.
    """
    return min(max(chunk_size, MIN_CHUNK), MAX_CHUNK)


def state_passing(
    hs: torch.Tensor,
    g: torch.Tensor | None,
    resets: torch.Tensor | None,
    h_init: torch.Tensor | None,
    h_last: torch.Tensor | None,
    T: int,
    BT: int,
    reverse: bool,
) -> None:
    """Launch :func:`state_passing_kernel` on hs [B, H, N, DX, DY] (in place).

    No dot here, so the state is cut into 32 x 32 blocks: a sequential loop over the
    chunks is latency bound, and more programs per head hide more of it.
    """
    B, H, N, DX, DY = hs.shape
    BX, BY = _block(DX, 32), _block(DY, 32)
    state_passing_kernel[(triton.cdiv(DX, BX) * triton.cdiv(DY, BY), B * H)](
        hs, g, resets, h_init, h_last, T, H, DX, DY, N,
        BT=BT, BX=BX, BY=BY, REVERSE=reverse, HAS_G=g is not None, HAS_R=resets is not None,
        HAS_INIT=h_init is not None, STORE_LAST=h_last is not None,
    )


def chunk_states(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    resets: torch.Tensor | None,
    h0: torch.Tensor | None,
    BT: int,
    store_last: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """States entering each chunk and the final state (stages 1 and 2).

    Args:
        k: [B, T, H, K], v: [B, T, H, V], g: [B, T, H] fp32 or None,
        resets: [B, T] int32 or None, h0: [B, H, K, V] fp32 or None.

    Returns:
        hs: [B, H, N, K, V] fp32, the state entering chunk n; h_last: [B, H, K, V] fp32.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    N = triton.cdiv(T, BT)
    BK, BV = _block(K), _block(V)
    NK, NV = triton.cdiv(K, BK), triton.cdiv(V, BV)
    hs = torch.empty(B, H, N, K, V, dtype=torch.float32, device=k.device)
    chunk_state_kernel[(N, NK * NV, B * H)](
        k, v, g, resets, hs, T, H, K, V, N,
        BT=BT, BX=BK, BY=BV, CARRY=False, HAS_G=g is not None, HAS_R=resets is not None,
        DOT_PREC=_dot_precision(k.dtype), UPCAST=_upcast(k.dtype),
    )
    h_last = torch.empty(B, H, K, V, dtype=torch.float32, device=k.device) if store_last else None
    state_passing(hs, g, resets, h0, h_last, T, BT, reverse=False)
    return hs, h_last


def chunk_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    resets: torch.Tensor | None,
    h0: torch.Tensor | None,
    BT: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward on prepared (contiguous, fp32 g/h0, int32 resets) inputs.

    Returns:
        o: [B, T, H, V] fp32 (the compute dtype, as the torch path), h_last: [B, H, K, V] fp32.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = triton.cdiv(T, BT)
    hs, h_last = chunk_states(k, v, g, resets, h0, BT)
    o = torch.empty(B, T, H, V, dtype=torch.float32, device=q.device)  # as the torch path
    BK, BV = _block(K), _block(V)
    chunk_fwd_o_kernel[(N, triton.cdiv(V, BV), B * H)](
        q, k, v, hs, g, resets, o, T, H, K, V, N,
        BT=BT, BK=BK, BV=BV, HAS_G=g is not None, HAS_R=resets is not None,
        DOT_PREC=_dot_precision(q.dtype), UPCAST=_upcast(q.dtype),
    )
    assert h_last is not None
    return o, h_last


def chunk_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    resets: torch.Tensor | None,
    h0: torch.Tensor | None,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    BT: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Backward on prepared inputs; the chunk states are recomputed, not saved.

    Args:
        do: [B, T, H, V] contiguous, in q's dtype; dht: [B, H, K, V] fp32 or None.

    Returns:
        dq, dk [B, T, H, K], dv [B, T, H, V] in the input dtypes; dg [B, T, H] fp32
        (None without g); dh0 [B, H, K, V] fp32 (None without h0).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = triton.cdiv(T, BT)
    BK, BV = _block(K), _block(V)
    NK, NV = triton.cdiv(K, BK), triton.cdiv(V, BV)
    HAS_G, HAS_R = g is not None, resets is not None
    prec = _dot_precision(q.dtype)
    # Recompute: the states entering each chunk (and h_T, needed for dg).
    hs, h_last = chunk_states(k, v, g, resets, h0, BT, store_last=HAS_G and dht is not None)
    # Gradients of the states: per chunk u_n = (q * wc)^T do, then the reverse pass.
    dhs = torch.empty(B, H, N, K, V, dtype=torch.float32, device=q.device)
    chunk_state_kernel[(N, NK * NV, B * H)](
        q, do, g, resets, dhs, T, H, K, V, N,
        BT=BT, BX=BK, BY=BV, CARRY=True, HAS_G=HAS_G, HAS_R=HAS_R,
        DOT_PREC=prec, UPCAST=_upcast(q.dtype),
    )
    dh0 = torch.empty(B, H, K, V, dtype=torch.float32, device=q.device) if h0 is not None else None
    state_passing(dhs, g, resets, dht, dh0, T, BT, reverse=True)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dv = torch.empty_like(v)
    dA = torch.empty(NK, B, T, H, dtype=torch.float32, device=q.device) if HAS_G else None
    chunk_bwd_dv_kernel[(N, NV, B * H)](
        q, k, do, dhs, g, resets, dv, T, H, K, V, N,
        BT=BT, BK=BK, BV=BV, HAS_G=HAS_G, HAS_R=HAS_R, DOT_PREC=prec, UPCAST=_upcast(q.dtype),
    )
    chunk_bwd_dqk_kernel[(N, NK, B * H)](
        q, k, v, do, hs, dhs, g, resets, dq, dk, dA, T, H, K, V, N,
        BT=BT, BK=BK, BV=BV, HAS_G=HAS_G, HAS_R=HAS_R, DOT_PREC=prec, UPCAST=_upcast(q.dtype),
    )
    dg = None
    if HAS_G:
        if dht is not None:
            assert h_last is not None
            d_last = (dht * h_last).sum((-2, -1))  # [B, H]: <dh_T, h_T>
        else:
            d_last = torch.zeros(B, H, dtype=torch.float32, device=q.device)
        dg = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
        reverse_cumsum_kernel[(B * H,)](dA, d_last, dg, B, T, H, N, NK=NK, BT=BT)
    return dq, dk, dv, dg, dh0


class ChunkLinearAttentionFunction(torch.autograd.Function):
    """Autograd of the Triton primitive; saves only the inputs."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor | None,
        resets: torch.Tensor | None,
        h0: torch.Tensor | None,
        BT: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        o, h_last = chunk_fwd(q, k, v, g, resets, h0, BT)
        ctx.save_for_backward(q, k, v, g, resets, h0)
        ctx.BT = BT
        ctx.set_materialize_grads(False)
        return o, h_last

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, do: torch.Tensor | None, dht: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, g, resets, h0 = ctx.saved_tensors
        if do is None:
            do = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
        # do meets v in a dot, so it takes the input dtype (o itself is fp32)
        dq, dk, dv, dg, dh0 = chunk_bwd(
            q, k, v, g, resets, h0, do.to(q.dtype).contiguous(),
            None if dht is None else dht.float().contiguous(), ctx.BT,
        )
        return dq, dk, dv, dg, None, dh0, None


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    resets: torch.Tensor | None,
    h0: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """Shape and dtype checks, then the layouts the kernels read.

    q, k, v contiguous in one dtype; g and h0 fp32 (differentiably: autograd casts
    their gradients back); resets int32.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    assert k.shape == (B, T, H, K), f"k: expected {(B, T, H, K)}, got {tuple(k.shape)}"
    assert v.shape[:3] == (B, T, H), f"v: expected leading dims {(B, T, H)}, got {tuple(v.shape)}"
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(
            f"the Triton path takes float32, float16 or bfloat16 inputs, got {q.dtype}; "
            "fp64 runs on the PyTorch path (HLA_SP_BACKEND=torch or auto)"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if g is not None:
        assert g.shape == (B, T, H), f"g: expected {(B, T, H)}, got {tuple(g.shape)}"
        g = g.float().contiguous()
    if resets is not None:
        assert resets.shape == (B, T), f"resets: expected {(B, T)}, got {tuple(resets.shape)}"
        resets = resets.to(torch.int32).contiguous()
    if h0 is not None:
        assert h0.shape == (B, H, K, V), f"h0: expected {(B, H, K, V)}, got {tuple(h0.shape)}"
        h0 = h0.float().contiguous()
    return q.contiguous(), k.contiguous(), v.contiguous(), g, resets, h0


def chunk_linear_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    *,
    resets: torch.Tensor | None = None,
    h0: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decayed causal linear attention with Triton kernels.

    Same signature and semantics as :func:`hla_sp.ops.chunk.chunk_linear_attention`.

    Args:
        q: [B, T, H, K], already scaled; k: [B, T, H, K]; v: [B, T, H, V]
            (fp32, fp16 or bf16, one dtype).
        g: [B, T, H] log-decay or None. resets: [B, T] bool or None.
        h0: [B, H, K, V] or None.
        chunk_size: requested chunk length; the kernels use it clamped to [16, 64]
            (see :func:`chunk_tile`).

    Returns:
        o: [B, T, H, V] and h_last: [B, H, K, V], both fp32 (the compute dtype, as the
        torch path returns them; the caller casts o).
    """
    q, k, v, g, resets, h0 = prepare(q, k, v, g, resets, h0)
    return ChunkLinearAttentionFunction.apply(q, k, v, g, resets, h0, chunk_tile(chunk_size))

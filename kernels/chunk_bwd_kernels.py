"""Backward Triton kernels of the primitive: dv, and dq/dk with the decay gradient dg.

The derivation (dA_t = q_t . dq_t - k_t . dk_t, dg a reverse cumsum of dA whose part
from later chunks is one inner product of states) is in :mod:`hla_sp.kernels.chunk`,
whose :func:`~hla_sp.kernels.chunk.chunk_bwd` launches them after the state passes of
:mod:`hla_sp.kernels.chunk_h_kernels`.
"""

from __future__ import annotations

import triton.language as tl

from ._decay import in_chunk_decay
from ._jit import lazy_jit
from ._round import finite, operand, round_to


@lazy_jit
def chunk_bwd_dv_kernel(
    q,  # [B, T, H, K]
    k,  # [B, T, H, K]
    do,  # [B, T, H, V]
    dhs,  # [B, H, N, K, V] fp32: gradient of the state leaving each chunk
    g,  # [B, T, H] fp32 (HAS_G)
    r,  # [B, T] int32 (HAS_R)
    dv,  # [B, T, H, V]: per query head (G > 1: the caller sums each group's G)
    scale,  # fp32: q's scale, applied to the fp32 products of q
    T,
    H,
    K,
    V,
    N,
    G: tl.constexpr,  # multi-query: q, do, dv have H heads, k, dhs, g H / G
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_G: tl.constexpr,
    HAS_R: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """dv_j = sum_t D[t, j] (q_t . k_j) do_t + ws_j (k_j^T dh_n), one [BT, BV] block.

    Multi-query: each query head's share; the state term, once per kv head, goes to the
    group's first query head."""
    i_n, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_bh = i_bh.to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    HK, i_kh = H // G, i_h // G
    o_i = tl.arange(0, BT)
    o_t = i_n * BT + o_i  # int32 is enough: T < 2^31; products with i_b are int64
    m_t = o_t < T
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V

    b_At = tl.zeros([BT, BT], dtype=tl.float32)  # (k_j . q_t)
    b_dv = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        p_q = ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :]
        p_k = ((i_b * T + o_t[:, None]) * HK + i_kh) * K + o_k[None, :]
        b_q = tl.load(q + p_q, mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_k = tl.load(k + p_k, mask=m_t[:, None] & m_k[None, :], other=0.0)
        p_dh = dhs + (((i_bh // G) * N + i_n) * K + o_k[:, None]) * V + o_v[None, :]
        b_dh = tl.load(p_dh, mask=m_k[:, None] & m_v[None, :], other=0.0)
        if UPCAST:
            b_q, b_k = b_q.to(tl.float32), b_k.to(tl.float32)
        b_q, b_k = finite(b_q), finite(b_k)  # clean operands (see _round.finite)
        b_At += tl.dot(b_k, tl.trans(b_q), input_precision=DOT_PREC)
        b_dh = operand(b_dh, q.dtype.element_ty, UPCAST)
        b_dv += tl.dot(b_k, b_dh, input_precision=DOT_PREC)
    p_v = ((i_b * T + o_t[:, None]) * H + i_h) * V + o_v[None, :]
    b_do = tl.load(do + p_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
    if UPCAST:
        b_do = b_do.to(tl.float32)
    b_do = finite(b_do)
    # the decay weights after the loop, as they are used: not live across it (registers)
    _, b_ws, _, b_D = in_chunk_decay(g, r, i_b, i_kh, o_t, T, HK, BT, HAS_G, HAS_R)
    b_ws = tl.where(i_h % G == 0, b_ws, 0.0)
    b_Dt = tl.trans(b_D)  # [BT(j), BT(t)]: row j (key), column t (query)
    b_AD = operand(b_At * (b_Dt * scale), q.dtype.element_ty, UPCAST)
    b_dv = b_dv * b_ws[:, None] + tl.dot(b_AD, b_do, input_precision=DOT_PREC)
    tl.store(dv + p_v, round_to(b_dv, dv.dtype.element_ty, UPCAST),
             mask=m_t[:, None] & m_v[None, :])


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
    dg,  # [NK, B, T, H] fp32: this K block's share of the decay gradient (HAS_G)
    dv,  # [B, T, H, V = K]: the value's gradient, added into dk (ADD_DV: v is k)
    scale,  # fp32: q's scale, applied to the fp32 products of q; dq is the raw q's
    T,
    H,
    K,
    V,
    N,
    G: tl.constexpr,  # multi-query: q, do, dq, dk, dg have H heads (dk, dg shares the caller
    # sums per group), k, v, hs, dhs, g H / G
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_G: tl.constexpr,
    HAS_R: tl.constexpr,
    ADD_DV: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """dq, dk of one chunk and one K block, and that block's share of dg; with
    ``ADD_DV`` (the value is the key, as in S = sum k k^T) dk + dv, summed in fp32.

    dq_t = sum_j D[t, j] (do_t . v_j) k_j + wc_t (h_in do_t)
    dk_j = sum_t D[t, j] (do_t . v_j) q_t + ws_j (dh_n v_j)
    dg_t = sum_{s >= t, s in t's segment and chunk} dA_s + [t in the last segment] R_n
    R_n  = <dh_n, h_out> = p_n <dh_n, h_in> + sum_j k_j . (ws_j dh_n v_j)
    """
    i_n, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_bh = i_bh.to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    HK, i_kh = H // G, i_h // G
    o_i = tl.arange(0, BT)
    o_t = i_n * BT + o_i  # int32 is enough: T < 2^31; products with i_b are int64
    m_t = o_t < T
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    b_hdh = tl.zeros([BK, BV], dtype=tl.float32)  # h_in * dh_n, summed at the end

    b_dP = tl.zeros([BT, BT], dtype=tl.float32)  # (do_t . v_j)
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        p_v = ((i_b * T + o_t[:, None]) * HK + i_kh) * V + o_v[None, :]  # [BT, BV]
        p_do = ((i_b * T + o_t[:, None]) * H + i_h) * V + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_do = tl.load(do + p_do, mask=m_t[:, None] & m_v[None, :], other=0.0)
        p_h = (((i_bh // G) * N + i_n) * K + o_k[:, None]) * V + o_v[None, :]
        b_h = tl.load(hs + p_h, mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_dh = tl.load(dhs + p_h, mask=m_k[:, None] & m_v[None, :], other=0.0)
        if UPCAST:
            b_v, b_do = b_v.to(tl.float32), b_do.to(tl.float32)
        b_v, b_do = finite(b_v), finite(b_do)  # clean operands (see _round.finite)
        b_h = operand(b_h, q.dtype.element_ty, UPCAST)
        b_dh = operand(b_dh, q.dtype.element_ty, UPCAST)
        b_dP += tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)
        b_dq += tl.dot(b_do, tl.trans(b_h), input_precision=DOT_PREC)
        b_dk += tl.dot(b_v, tl.trans(b_dh), input_precision=DOT_PREC)
        if HAS_G:
            b_hdh += b_h.to(tl.float32) * b_dh.to(tl.float32)
    p_qk = ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :]  # [BT, BK]
    m_qk = m_t[:, None] & m_k[None, :]
    b_q = tl.load(q + p_qk, mask=m_qk, other=0.0)
    b_k = tl.load(k + ((i_b * T + o_t[:, None]) * HK + i_kh) * K + o_k[None, :], mask=m_qk,
                  other=0.0)
    if UPCAST:
        b_q, b_k = b_q.to(tl.float32), b_k.to(tl.float32)
    b_q, b_k = finite(b_q), finite(b_k)
    # the decay weights after the loop, as they are used: not live across it (registers)
    b_wc, b_ws, b_p, b_D = in_chunk_decay(g, r, i_b, i_kh, o_t, T, HK, BT, HAS_G, HAS_R)
    # dk's state term and the chunk's R_n: once per kv head
    b_ws = tl.where(i_h % G == 0, b_ws, 0.0)
    b_p = tl.where(i_h % G == 0, b_p, 0.0)
    b_dP = operand(b_dP * b_D, q.dtype.element_ty, UPCAST)
    b_dks = b_dk * b_ws[:, None]  # the state's part of dk
    b_dq = b_dq * b_wc[:, None] + tl.dot(b_dP, b_k, input_precision=DOT_PREC)
    # dq_s, dk of the scaled q's problem; dq = scale dq_s (the raw q's)
    b_dk = b_dks + scale * tl.dot(tl.trans(b_dP), b_q, input_precision=DOT_PREC)
    tl.store(dq + p_qk, round_to(b_dq * scale, dq.dtype.element_ty, UPCAST), mask=m_qk)
    b_dkv = b_dk
    if ADD_DV:  # the same [BT, BK] block of dv (V = K, one layout)
        b_dkv += tl.load(dv + p_qk, mask=m_qk, other=0.0).to(tl.float32)
    tl.store(dk + p_qk, round_to(b_dkv, dk.dtype.element_ty, UPCAST), mask=m_qk)
    if HAS_G:
        b_qf, b_kf = b_q.to(tl.float32), b_k.to(tl.float32)
        # this K block's part of dA_t = q_t . dq_t - k_t . dk_t, from the fp32 values
        b_dA = tl.sum(scale * b_qf * b_dq - b_kf * b_dk, 1)  # [BT]
        # and of R_n, what the later chunks add to the chunk's last segment
        b_R = b_p * tl.sum(tl.sum(b_hdh, 1), 0) + tl.sum(tl.sum(b_kf * b_dks, 1), 0)
        # segments: cut at document starts and log-decays of -inf. Across a cut the
        # later terms sum to zero, but only up to rounding, and they would carry a later
        # segment's values (or a NaN) into an earlier one's gradient: they are left out
        b_g = tl.load(g + (i_b * T + o_t) * HK + i_kh, mask=m_t, other=0.0)
        b_cut = (b_g == float("-inf")).to(tl.int32)
        if HAS_R:
            b_cut = b_cut | tl.load(r + i_b * T + o_t, mask=m_t, other=0)
        b_seg = tl.cumsum(b_cut, 0)
        m_sum = (o_i[None, :] >= o_i[:, None]) & (b_seg[None, :] == b_seg[:, None])  # [t, s]
        b_dg = tl.sum(tl.where(m_sum, b_dA[None, :], 0.0), 1)
        b_dg += tl.where(b_seg == tl.max(b_seg, 0), b_R, 0.0)
        n_b = tl.num_programs(2) // H  # B
        tl.store(dg + ((i_k * n_b + i_b) * T + o_t) * H + i_h, b_dg, mask=m_t)

"""The primitive's output kernel (after the state pass of :mod:`hla_sp.kernels.chunk_h_kernels`).

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
def chunk_fwd_o_kernel(
    q,  # [B, T, H, K]
    k,  # [B, T, H, K]
    v,  # [B, T, H, V]
    hs,  # [B, H, N, K, V] fp32 states entering each chunk
    g,  # [B, T, H] fp32 (HAS_G)
    r,  # [B, T] int32 (HAS_R)
    o,  # [B, T, H, V]
    scale,  # fp32: q's scale, applied to the fp32 products of q (1.0: q came scaled)
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
    # the decay weights after the loop, as they are used: not live across it (registers)
    b_wc, _, _, b_D = in_chunk_decay(g, r, i_b, i_kh, o_t, T, HK, BT, HAS_G, HAS_R)
    # q's scale on the fp32 products (no register held for a scaled q)
    b_AD = operand(b_A * (b_D * scale), q.dtype.element_ty, UPCAST)
    b_o = b_o * (b_wc * scale)[:, None] + tl.dot(b_AD, b_v, input_precision=DOT_PREC)
    p_o = ((i_b * T + o_t[:, None]) * H + i_h) * V + o_v[None, :]
    tl.store(o + p_o, round_to(b_o, o.dtype.element_ty, UPCAST), mask=m_t[:, None] & m_v[None, :])

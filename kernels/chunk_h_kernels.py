"""The primitive's state passes: one kernel per direction, the state held on chip.

Forward (:func:`chunk_fwd_h_kernel`), for one [BK, BV] block of one (batch, head):

    h = h0;  for n = 0..N-1:  hs[n] = h;  h = p_n h + (k_n * ws_n)^T v_n
    h_T = h

Backward (:func:`chunk_bwd_dh_kernel`), for one [BK, BV] block of one (batch, kv head):

    dh = dh_T;  for n = N-1..0:  dhs[n] = dh;  dh = p_n dh + sum_G (q_n * wc_n)^T do_n
    dh0 = dh

The state stays in fp32 registers across the loop. The loads of a chunk's k and v (q
and do) and its decay weights do not depend on the state, so they are issued ahead of
the state's update; the update is one scalar rescale and one dot per chunk. Document
starts and hard resets are selects inside the weights (p_n = 0, ws_j = 0 before a
start, wc_t = 0 after one): :func:`hla_sp.kernels._decay.in_chunk_decay`, of which
these kernels read no [BT, BT] pair weight.

With ``FLAG`` each pass also raises the flags of the non-finite rows it reads (k, v,
the decay and h0 forward; q, the cotangent and dh_T backward) from the comparison it
makes to clean them (:mod:`hla_sp.kernels._flags`): isolation needs no pass of its own.

The per-chunk states are stored in ``hs``'s dtype: the inputs' dtype for 16-bit inputs
(the output and gradient kernels round them to that dtype as dot operands anyway, so
the result is unchanged and the traffic halves), fp32 for fp32 inputs.
"""

from __future__ import annotations

import triton.language as tl

from ._decay import in_chunk_decay
from ._flags import raise_state, raise_tokens, rows_bad
from ._jit import lazy_jit
from ._round import finite, operand, round_to


@lazy_jit
def chunk_fwd_h_kernel(
    k,  # [B, T, H, K]
    v,  # [B, T, H, V]
    g,  # [B, T, H] fp32 log-decay (HAS_G)
    r,  # [B, T] int32 document starts (HAS_R)
    h0,  # [B, H, K, V] fp32 (HAS_INIT)
    hs,  # [B, H, N, K, V] out: the state entering each chunk
    ht,  # [B, H, K, V] fp32 out: the final state (STORE_LAST)
    fl,  # [B, T + 2, H] int32 flags, raised here (FLAG; :mod:`hla_sp.kernels._flags`)
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
    HAS_INIT: tl.constexpr,
    STORE_LAST: tl.constexpr,
    FLAG: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The forward state pass over every chunk, one [BK, BV] block of the state; with
    ``FLAG``, the flags of the non-finite k, v, decay and h0 it reads on the way."""
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_bh = i_bh.to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_i = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]  # [BK, BV] offsets inside one state
    if HAS_INIT:
        b_h = tl.load(h0 + i_bh * K * V + o_kv, mask=m_kv, other=0.0)
        if FLAG:
            raise_state(fl, i_b, i_h, T, H, b_h)
        b_h = finite(b_h)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    for i_n in range(N):
        tl.store(hs + (i_bh * N + i_n) * K * V + o_kv,
                 round_to(b_h, hs.dtype.element_ty, UPCAST), mask=m_kv)
        o_t = i_n * BT + o_i  # int32 is enough: T < 2^31; products with i_b are int64
        m_t = o_t < T
        p_k = k + ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :]  # [BT, BK]
        p_v = v + ((i_b * T + o_t[:, None]) * H + i_h) * V + o_v[None, :]  # [BT, BV]
        b_k = tl.load(p_k, mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_v = tl.load(p_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
        if UPCAST:
            b_k, b_v = b_k.to(tl.float32), b_v.to(tl.float32)
        if FLAG:
            b_bad = rows_bad(b_k) | rows_bad(b_v)
            if HAS_G:  # NaN or +inf; -inf is a cut
                b_bad = b_bad | ~(tl.load(g + (i_b * T + o_t) * H + i_h, mask=m_t, other=0.0)
                                  < float("inf"))
            raise_tokens(fl, i_b, i_h, o_t, m_t, T, H, b_bad)
        b_k, b_v = finite(b_k), finite(b_v)  # a zero weight times NaN is still NaN
        _, b_ws, b_p, _ = in_chunk_decay(g, r, i_b, i_h, o_t, T, H, BT, HAS_G, HAS_R)
        b_kw = operand(b_k * b_ws[:, None], k.dtype.element_ty, UPCAST)  # [BT, BK]
        b_h = b_p * b_h + tl.dot(tl.trans(b_kw), b_v, input_precision=DOT_PREC)
    if STORE_LAST:
        tl.store(ht + i_bh * K * V + o_kv, b_h, mask=m_kv)


@lazy_jit
def chunk_bwd_dh_kernel(
    q,  # [B, T, H, K] (H query heads, G per kv head)
    do,  # [B, T, H, V]
    g,  # [B, T, H / G] fp32 log-decay (HAS_G)
    r,  # [B, T] int32 document starts (HAS_R)
    dht,  # [B, H / G, K, V] fp32 (HAS_FINAL), read clean
    dhs,  # [B, H / G, N, K, V] out: the gradient of the state leaving each chunk
    dh0,  # [B, H / G, K, V] fp32 out (STORE_INIT)
    fl,  # [B, T + 2, H / G] int32 flags of q, do and dh_T, raised here (FLAG)
    scale,  # fp32: q's scale, applied to the chunk's fp32 sum over q
    T,
    H,
    K,
    V,
    N,
    G: tl.constexpr,  # query heads per kv head: their shares are summed here, in fp32
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_G: tl.constexpr,
    HAS_R: tl.constexpr,
    HAS_FINAL: tl.constexpr,
    STORE_INIT: tl.constexpr,
    FLAG: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The reverse state pass over every chunk, one [BK, BV] block of a kv head's state;
    with ``FLAG``, the flags of the non-finite q, do (any head of the group) and dh_T."""
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_bh = i_bh.to(tl.int64)  # (batch, kv head)
    HK = H // G
    i_b, i_kh = i_bh // HK, i_bh % HK
    o_i = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    if HAS_FINAL:
        b_dh = tl.load(dht + i_bh * K * V + o_kv, mask=m_kv, other=0.0)
        if FLAG:
            raise_state(fl, i_b, i_kh, T, HK, b_dh)
        b_dh = finite(b_dh)
    else:
        b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    for i in range(N):
        i_n = N - 1 - i
        tl.store(dhs + (i_bh * N + i_n) * K * V + o_kv,
                 round_to(b_dh, dhs.dtype.element_ty, UPCAST), mask=m_kv)
        o_t = i_n * BT + o_i
        m_t = o_t < T
        b_wc, _, b_p, _ = in_chunk_decay(g, r, i_b, i_kh, o_t, T, HK, BT, HAS_G, HAS_R)
        b_u = tl.zeros([BK, BV], dtype=tl.float32)
        b_bad = m_t & (o_i < 0)  # all False
        for j in tl.static_range(G):
            i_h = i_kh * G + j
            p_q = q + ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :]
            p_do = do + ((i_b * T + o_t[:, None]) * H + i_h) * V + o_v[None, :]
            b_q = tl.load(p_q, mask=m_t[:, None] & m_k[None, :], other=0.0)
            b_do = tl.load(p_do, mask=m_t[:, None] & m_v[None, :], other=0.0)
            if UPCAST:
                b_q, b_do = b_q.to(tl.float32), b_do.to(tl.float32)
            if FLAG:
                b_bad = b_bad | rows_bad(b_q) | rows_bad(b_do)
            b_q, b_do = finite(b_q), finite(b_do)
            b_qw = operand(b_q * b_wc[:, None], q.dtype.element_ty, UPCAST)  # [BT, BK]
            b_u += tl.dot(tl.trans(b_qw), b_do, input_precision=DOT_PREC)
        if FLAG:
            raise_tokens(fl, i_b, i_kh, o_t, m_t, T, HK, b_bad)
        b_dh = b_p * b_dh + b_u * scale
    if STORE_INIT:
        tl.store(dh0 + i_bh * K * V + o_kv, b_dh, mask=m_kv)

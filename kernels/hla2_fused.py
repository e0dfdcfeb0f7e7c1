"""Fused second-order HLA: k~ = S q and the output per chunk, k~ kept on chip.

The composition ``hla2 = LA(q, LA(q, k, k), v)`` writes the data-dependent key
k~ (B*T*H*K values) to global memory between its two stages, and reads it back
twice. With the masks D, ws, wc and pass factor p of :mod:`hla_sp.kernels.chunk`,
chunk n needs only the stage-1 state S entering it to rebuild its keys:

    k~  = ((q k^T) * D) k + wc * (q S_in[n]) + ridge * q       stage 1, [BT, K]
    o   = ((q k~^T) * D) v + wc * (q H_in[n])                  stage 2, [BT, V]
    S_in[n+1] = p S_in[n] + (k * ws)^T k,   H_in[n+1] = p H_in[n] + (k~ * ws)^T v

Two forms, both keeping k~ out of global memory in the forward:

- ``mode="sequential"`` (:func:`fused_hla2_fwd_kernel`): one program per (batch,
  head, V block) walks the chunks in order with S and H on chip: one pass, no state
  buffers, but only B*H*ceil(V/BV) programs and a K x K fp32 state per program.
- ``mode="chunked"`` (the default): chunk-parallel like the primitive. S_in comes
  from the primitive's state kernels (values = k); :func:`hla2_state_kernel`
  rebuilds k~ per chunk and writes only the chunk's stage-2 state; the state passing
  gives H_in; :func:`hla2_fwd_o_kernel` rebuilds k~ again and writes o. k~ is
  computed twice on chip instead of being stored once and read twice.

Whether either beats the two-stage composition is a GPU measurement
(benchmarks/gpu_check.sh times both); until then this is opt-in: call
:func:`hla2_fused`; the default ``hla_sp.hla2`` stays the composition.

The backward recomputes k~ with the primitive's forward kernels, then runs the
primitive's backward kernels for stage 2 and for stage 1 (k~ exists only during the
backward) and adds the pieces: dq = dq1 + dq2 + ridge dk~, dk = dk1 + dv1 (k is both
key and value of stage 1), dg = dg1 + dg2.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from hla_sp.ops import validate
from hla_sp.ops.compositions import DEFAULT_EPS, HLA2State

from ._jit import lazy_jit
from .chunk import (
    _block,
    _dot_precision,
    _upcast,
    chunk_bwd,
    chunk_fwd,
    chunk_states,
    chunk_tile,
    prepare,
    state_passing,
)


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
    m_causal = o_i[:, None] >= o_i[None, :]
    # b_S: [BK, BK], b_H: [BK, BV], both fp32
    if HAS_S0:
        b_S = tl.load(S0 + (i_bh * K + o_k[:, None]) * K + o_k[None, :], mask=m_kk, other=0.0)
    else:
        b_S = tl.zeros([BK, BK], dtype=tl.float32)
    if HAS_H0:
        b_H = tl.load(H0 + (i_bh * K + o_k[:, None]) * V + o_v[None, :], mask=m_kv, other=0.0)
    else:
        b_H = tl.zeros([BK, BV], dtype=tl.float32)
    for i_n in range(N):
        o_t = i_n * BT + o_i
        m_t = o_t < T
        if HAS_G:
            b_b = tl.cumsum(tl.load(g + (i_b * T + o_t) * H + i_h, mask=m_t, other=0.0), 0)
        else:
            b_b = tl.zeros([BT], dtype=tl.float32)
        b_bC = tl.sum(tl.where(o_i == BT - 1, b_b, 0.0), 0)
        b_wc = tl.exp(b_b)
        b_ws = tl.exp(b_bC - b_b)
        b_p = tl.exp(b_bC)
        m_D = m_causal
        if HAS_R:
            b_c = tl.cumsum(tl.load(r + i_b * T + o_t, mask=m_t, other=0), 0)
            b_cC = tl.sum(tl.where(o_i == BT - 1, b_c, 0), 0)
            b_wc = tl.where(b_c == 0, b_wc, 0.0)
            b_ws = tl.where(b_c == b_cC, b_ws, 0.0)
            b_p = tl.where(b_cC == 0, b_p, 0.0)
            m_D = m_D & (b_c[:, None] == b_c[None, :])
        b_D = tl.exp(tl.where(m_D, b_b[:, None] - b_b[None, :], float("-inf")))  # [BT, BT]

        p_qk = ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :]  # [BT, BK]
        b_q = tl.load(q + p_qk, mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_k = tl.load(k + p_qk, mask=m_t[:, None] & m_k[None, :], other=0.0)
        p_v = ((i_b * T + o_t[:, None]) * H + i_h) * V + o_v[None, :]  # [BT, BV]
        b_v = tl.load(v + p_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
        if UPCAST:
            b_q, b_k, b_v = b_q.to(tl.float32), b_k.to(tl.float32), b_v.to(tl.float32)
        # stage 1: k~ [BT, BK] in fp32, kept on chip
        b_A = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * b_D
        b_kt = tl.dot(b_A.to(q.dtype.element_ty).to(b_k.dtype), b_k, input_precision=DOT_PREC)
        b_qS = tl.dot(b_q, b_S.to(q.dtype.element_ty).to(b_q.dtype), input_precision=DOT_PREC)
        b_kt = b_kt + b_wc[:, None] * b_qS + ridge * b_q.to(tl.float32)
        b_ktd = b_kt.to(q.dtype.element_ty).to(b_q.dtype)  # dot operand
        # stage 2: o [BT, BV]
        b_B = tl.dot(b_q, tl.trans(b_ktd), input_precision=DOT_PREC) * b_D
        b_o = tl.dot(b_B.to(q.dtype.element_ty).to(b_v.dtype), b_v, input_precision=DOT_PREC)
        b_qH = tl.dot(b_q, b_H.to(q.dtype.element_ty).to(b_q.dtype), input_precision=DOT_PREC)
        b_o += b_wc[:, None] * b_qH
        tl.store(o + p_v, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
        # the states leaving the chunk
        b_kw = (b_k * b_ws[:, None]).to(q.dtype.element_ty).to(b_k.dtype)
        b_S = b_p * b_S + tl.dot(tl.trans(b_kw), b_k, input_precision=DOT_PREC)
        b_ktw = (b_kt * b_ws[:, None]).to(q.dtype.element_ty).to(b_v.dtype)
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
        b_A += tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
        b_qS += tl.dot(b_q, b_S.to(q.dtype.element_ty).to(b_q.dtype), input_precision=DOT_PREC)
    p_x = ((i_b * T + o_t[:, None]) * H + i_h) * K + o_x[None, :]  # [BT, BK]
    b_qx = tl.load(q + p_x, mask=m_t[:, None] & m_x[None, :], other=0.0)
    b_kx = tl.load(k + p_x, mask=m_t[:, None] & m_x[None, :], other=0.0)
    p_v = ((i_b * T + o_t[:, None]) * H + i_h) * V + o_v[None, :]  # [BT, BV]
    b_v = tl.load(v + p_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
    if UPCAST:
        b_qx, b_kx, b_v = b_qx.to(tl.float32), b_kx.to(tl.float32), b_v.to(tl.float32)
    b_AD = (b_A * b_D).to(q.dtype.element_ty).to(b_kx.dtype)
    b_kt = tl.dot(b_AD, b_kx, input_precision=DOT_PREC) + b_wc[:, None] * b_qS
    b_kt += ridge * b_qx.to(tl.float32)  # k~[:, x], [BT, BK] fp32
    b_ktw = (b_kt * b_ws[:, None]).to(q.dtype.element_ty).to(b_v.dtype)
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
    m_D = o_i[:, None] >= o_i[None, :]
    if HAS_G:
        b_b = tl.cumsum(tl.load(g + (i_b * T + o_t) * H + i_h, mask=m_t, other=0.0), 0)
    else:
        b_b = tl.zeros([BT], dtype=tl.float32)
    b_wc = tl.exp(b_b)
    if HAS_R:
        b_c = tl.cumsum(tl.load(r + i_b * T + o_t, mask=m_t, other=0), 0)
        b_wc = tl.where(b_c == 0, b_wc, 0.0)
        m_D = m_D & (b_c[:, None] == b_c[None, :])
    b_D = tl.exp(tl.where(m_D, b_b[:, None] - b_b[None, :], float("-inf")))  # [BT, BT]

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
        b_A += tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
    b_AD = (b_A * b_D).to(q.dtype.element_ty)  # [BT, BT] dot operand

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
        # k~[:, x] = ((q k^T) * D) k[:, x] + wc * (q S_in)[:, x] + ridge q[:, x]
        b_qS = tl.zeros([BT, BK], dtype=tl.float32)
        for i_k in range(NK):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            p_qk = ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :]
            b_q = tl.load(q + p_qk, mask=m_t[:, None] & m_k[None, :], other=0.0)
            if UPCAST:
                b_q = b_q.to(tl.float32)
            p_S = Ss + ((i_bh * N + i_n) * K + o_k[:, None]) * K + o_x[None, :]
            b_S = tl.load(p_S, mask=m_k[:, None] & m_x[None, :], other=0.0)
            b_S = b_S.to(q.dtype.element_ty).to(b_q.dtype)
            b_qS += tl.dot(b_q, b_S, input_precision=DOT_PREC)
        b_kt = tl.dot(b_AD.to(b_kx.dtype), b_kx, input_precision=DOT_PREC)
        b_kt += b_wc[:, None] * b_qS + ridge * b_qx.to(tl.float32)
        b_ktd = b_kt.to(q.dtype.element_ty).to(b_qx.dtype)
        b_Bm += tl.dot(b_qx, tl.trans(b_ktd), input_precision=DOT_PREC)
        p_h = hs + ((i_bh * N + i_n) * K + o_x[:, None]) * V + o_v[None, :]  # [BK, BV]
        b_h = tl.load(p_h, mask=m_x[:, None] & m_v[None, :], other=0.0)
        b_o += tl.dot(b_qx, b_h.to(q.dtype.element_ty).to(b_qx.dtype), input_precision=DOT_PREC)
    p_v = ((i_b * T + o_t[:, None]) * H + i_h) * V + o_v[None, :]
    b_v = tl.load(v + p_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
    if UPCAST:
        b_v = b_v.to(tl.float32)
    b_BD = (b_Bm * b_D).to(q.dtype.element_ty).to(b_v.dtype)
    b_o = b_o * b_wc[:, None] + tl.dot(b_BD, b_v, input_precision=DOT_PREC)
    tl.store(o + p_v, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


MAX_FUSED_K = 128  # the sequential program holds a K x K fp32 state
MODES = ("chunked", "sequential")


def fused_hla2_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    resets: torch.Tensor | None,
    S0: torch.Tensor | None,
    H0: torch.Tensor | None,
    ridge: float,
    BT: int,
    mode: str = "chunked",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward on prepared inputs. Returns o [B, T, H, V], S_T, H_T, all fp32."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = triton.cdiv(T, BT)
    o = torch.empty(B, T, H, V, dtype=torch.float32, device=q.device)  # cast by the caller
    flags = dict(
        HAS_G=g is not None, HAS_R=resets is not None,
        DOT_PREC=_dot_precision(q.dtype), UPCAST=_upcast(q.dtype),
    )
    if mode == "chunked":
        BK, BV = _block(K), _block(V)
        NK, NV = triton.cdiv(K, BK), triton.cdiv(V, BV)
        Ss, S_T = chunk_states(k, k, g, resets, S0, BT)  # stage-1 states entering each chunk
        hs = torch.empty(B, H, N, K, V, dtype=torch.float32, device=q.device)
        hla2_state_kernel[(N, NK * NV, B * H)](
            q, k, v, Ss, g, resets, hs, float(ridge), T, H, K, V, N,
            BT=BT, BK=BK, BV=BV, **flags,
        )
        H_T = torch.empty(B, H, K, V, dtype=torch.float32, device=q.device)
        state_passing(hs, g, resets, H0, H_T, T, BT, reverse=False)
        hla2_fwd_o_kernel[(N, NV, B * H)](
            q, k, v, Ss, hs, g, resets, o, float(ridge), T, H, K, V, N,
            BT=BT, BK=BK, BV=BV, **flags,
        )
        assert S_T is not None
        return o, S_T, H_T
    if mode != "sequential":
        raise ValueError(f"fused hla2: mode must be one of {MODES}, got {mode!r}")
    if K > MAX_FUSED_K:
        raise ValueError(f"fused hla2 (sequential): expected K <= {MAX_FUSED_K}, got K = {K}")
    BK = max(16, triton.next_power_of_2(K))
    BV = _block(V)
    S_T = torch.empty(B, H, K, K, dtype=torch.float32, device=q.device)
    H_T = torch.empty(B, H, K, V, dtype=torch.float32, device=q.device)
    fused_hla2_fwd_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, v, g, resets, S0, H0, o, S_T, H_T, float(ridge), T, H, K, V, N,
        BT=BT, BK=BK, BV=BV, HAS_S0=S0 is not None, HAS_H0=H0 is not None, **flags,
        # a program holds S (K x K) and H (K x BV) in fp32: more warps, fewer spills
        num_warps=8 if BK > 64 else 4,
    )
    return o, S_T, H_T


def fused_hla2_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    resets: torch.Tensor | None,
    S0: torch.Tensor | None,
    H0: torch.Tensor | None,
    ridge: float,
    do: torch.Tensor,
    dS_T: torch.Tensor | None,
    dH_T: torch.Tensor | None,
    BT: int,
) -> tuple[torch.Tensor | None, ...]:
    """Backward on prepared inputs: recompute k~, then the primitive's backward twice.

    Returns dq, dk, dv (input dtypes), dg (fp32 or None), dS0, dH0 (fp32 or None).
    """
    kt, _ = chunk_fwd(q, k, k, g, resets, S0, BT)  # stage 1 output, fp32
    if ridge:
        kt = kt + ridge * q.float()
    kt = kt.to(q.dtype)  # a dot operand, rounded as in the forward kernel
    dq2, dkt, dv, dg2, dH0 = chunk_bwd(q, kt, v, g, resets, H0, do, dH_T, BT)
    dq1, dk1, dv1, dg1, dS0 = chunk_bwd(q, k, k, g, resets, S0, dkt, dS_T, BT)
    dq = dq1.float() + dq2.float()
    if ridge:
        dq = dq + ridge * dkt.float()
    dk = dk1.float() + dv1.float()
    dg = None if g is None else dg1 + dg2  # type: ignore[operator]
    return dq.to(q.dtype), dk.to(k.dtype), dv, dg, dS0, dH0


class FusedHLA2Function(torch.autograd.Function):
    """Autograd of the fused hla2; saves only the inputs."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor | None,
        resets: torch.Tensor | None,
        S0: torch.Tensor | None,
        H0: torch.Tensor | None,
        ridge: float,
        BT: int,
        mode: str,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        o, S_T, H_T = fused_hla2_fwd(q, k, v, g, resets, S0, H0, ridge, BT, mode)
        ctx.save_for_backward(q, k, v, g, resets, S0, H0)
        ctx.ridge, ctx.BT = ridge, BT
        ctx.set_materialize_grads(False)
        return o, S_T, H_T

    @staticmethod
    def backward(
        ctx: Any, do: torch.Tensor | None, dS_T: torch.Tensor | None, dH_T: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, g, resets, S0, H0 = ctx.saved_tensors
        if do is None:
            do = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
        dq, dk, dv, dg, dS0, dH0 = fused_hla2_bwd(
            q, k, v, g, resets, S0, H0, ctx.ridge, do.to(q.dtype).contiguous(),
            None if dS_T is None else dS_T.float().contiguous(),
            None if dH_T is None else dH_T.float().contiguous(), ctx.BT,
        )
        return dq, dk, dv, dg, None, dS0, dH0, None, None, None


def fused_hla2_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    *,
    resets: torch.Tensor | None = None,
    S0: torch.Tensor | None = None,
    H0: torch.Tensor | None = None,
    ridge: float = 0.0,
    chunk_size: int = 64,
    mode: str = "chunked",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hla2 of already-scaled q, fused; the counterpart of the primitive's chunk function.

    Args:
        q: [B, T, H, K] scaled; k: [B, T, H, K]; v: [B, T, H, V] (fp32/fp16/bf16).
        g: [B, T, H] log-decay or None; resets: [B, T] bool or None.
        S0: [B, H, K, K], H0: [B, H, K, V] initial states or None.
        mode: "chunked" (chunk-parallel) or "sequential" (one program walks the chunks).

    Returns:
        o [B, T, H, V], S_T [B, H, K, K] and H_T [B, H, K, V], all fp32.
    """
    q, k, v, g, resets, H0 = prepare(q, k, v, g, resets, H0)
    if S0 is not None:
        K = q.shape[-1]
        assert S0.shape == (q.shape[0], q.shape[2], K, K), f"S0: got {tuple(S0.shape)}"
        S0 = S0.float().contiguous()
    if mode not in MODES:
        raise ValueError(f"fused hla2: mode must be one of {MODES}, got {mode!r}")
    return FusedHLA2Function.apply(
        q, k, v, g, resets, S0, H0, float(ridge), chunk_tile(chunk_size), mode
    )


def hla2_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: torch.Tensor | None = None,
    normalize: bool = False,
    eps: float = DEFAULT_EPS,
    ridge: float = 0.0,
    scale: float | None = None,
    initial_state: HLA2State | tuple | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    mode: str = "chunked",
) -> tuple[torch.Tensor, HLA2State | None]:
    """:func:`hla_sp.hla2` on the fused kernels (opt-in; single process, no ``sp``).

    Same keywords and results as ``hla_sp.hla2``. Packed documents (``cu_seqlens``)
    are supported without initial or final states (per-document states are the
    composition's job). Inputs must be on a device Triton runs on (CUDA, or CPU under
    ``TRITON_INTERPRET=1``). ``mode``: "chunked" or "sequential" (module docstring).
    """
    x = validate.check_inputs(
        q, k, v, log_decay=log_decay, scale=scale, cu_seqlens=cu_seqlens, sp=None,
        chunk_size=chunk_size,
    )
    if x.cu_seqlens is not None and (initial_state is not None or output_final_state):
        raise NotImplementedError(
            "hla2_fused: cu_seqlens with initial_state or output_final_state; use hla_sp.hla2"
        )
    from hla_sp.ops.dispatch import triton_unavailable_reason

    reason = triton_unavailable_reason(x.q.device, x.q.dtype)
    if reason is not None:
        raise RuntimeError(f"hla2_fused needs the Triton kernels, but {reason}")
    N, H, K, V = x.n_seq, x.H, x.K, x.V
    S0 = H0 = eta0 = None
    if initial_state is not None:
        S0, H0, *rest = (*tuple(initial_state), None)
        eta0 = rest[0]
        S0 = validate.check_state("initial_state.S", S0, (N, H, K, K), x.q)
        H0 = validate.check_state("initial_state.H", H0, (N, H, K, V), x.q)
        if normalize:
            eta0 = validate.check_state("initial_state.eta", eta0, (N, H, K), x.q)
            if eta0 is None:
                raise ValueError("initial_state.eta: expected a tensor when normalize=True")
    resets = None
    if x.cu_seqlens is not None:
        resets = torch.zeros(1, x.T, dtype=torch.bool, device=x.q.device)
        resets[0, x.cu_seqlens[1:-1].to(x.q.device)] = True
    qs, vv = x.q * x.scale, x.v
    if normalize:
        # den is stage 2 with a ones column appended to v
        vv = torch.cat([vv, torch.ones_like(vv[..., :1])], dim=-1)
        if H0 is not None:
            H0 = torch.cat([H0, eta0[..., None].to(H0.dtype)], dim=-1)
    o, S_T, H_T = fused_hla2_chunk(
        qs, x.k, vv, x.g, resets=resets, S0=S0, H0=H0, ridge=ridge, chunk_size=x.chunk_size,
        mode=mode,
    )
    eta = None
    if normalize:
        o = o[..., :V].float() / (o[..., V:].float() + eps)
        H_T, eta = H_T[..., :V], H_T[..., V]
    state = HLA2State(S_T, H_T, eta) if output_final_state else None
    return o.to(x.q.dtype), state

"""Triton kernels of the primitive: chunked decayed causal linear attention.

    h_t = exp(g_t) h_{t-1} + k_t v_t^T   (K x V, fp32),   o_t = q_t^T h_t

The work is split as in fla (``chunk_fwd_h`` -> ``chunk_fwd_o``):

1. :func:`chunk_fwd_h_kernel`  one program per state block walks the chunks with the
   state in registers: hs[n] = h (the state entering chunk n), h = p_n h + s_n,
   s_n = sum_j ws_j k_j v_j^T
2. :func:`chunk_fwd_o_kernel`  per chunk: o = ((q k^T) * D) v + wc * (q hs[n])

With b the within-chunk cumulative log-decay and c the number of document starts
(``resets``) seen so far in the chunk:

    D[t, j] = exp(b_t - b_j) [j <= t] [c_t == c_j]     pair weight inside a chunk
    ws_j    = exp(b_C - b_j) [c_j == c_C]              weight of token j in the chunk state
    wc_t    = exp(b_t) [c_t == 0]                       weight of the incoming state
    p_n     = exp(b_C) [c_C == 0]                       pass factor of chunk n

exactly as in :mod:`hla_sp.ops.chunk`. The backward mirrors it: the states are
recomputed (1) instead of being saved by the forward, :func:`chunk_bwd_dh_kernel`
runs the state gradients in reverse (dhs[n], the gradient of the state leaving chunk
n), and two per-chunk kernels give dv and dq, dk with the decay gradient. With
A = cumsum(g), every term of the output and of the final state has the form
exp(A_dest - A_src) * (...), so

    dA_t = q_t . dq_t - k_t . dk_t  (+ <dh_T, h_T> at the last token)
    dg_t = sum_{s >= t} dA_s

The part of that sum from the chunks after t's is the gradient of a scalar rescale of
the state leaving t's chunk, R_n = <dhs[n], h_out[n]> = p_n <dhs[n], hs[n]> +
sum_j ws_j k_j^T dhs[n] v_j (the last from dk's state term), so each chunk adds R_n to
a chunk-local reverse cumsum of dA and no pass runs serially over T (the last chunk's
R is <dh_T, h_T>). dg is summed over t's segment only (cut at document starts and
log-decays of -inf): the terms of a later segment cancel only to rounding. Every
kernel computes on clean operands (NaN and ±inf read as 0,
:func:`hla_sp.kernels._round.finite`); the autograd glue in :mod:`hla_sp.ops` puts
the poison of non-finite inputs back by flags.

The h0 terms need nothing extra: exp(A_t) q_t^T h0 is inside q_t . dq_t, and
exp(A_T) h0 is inside <dh_T, h_T>.

Every offset is int64 (B*T*H*K passes 2^31 at a million tokens), and the chunk index
is on grid axis 0, which CUDA allows up to 2^31 - 1 (axes 1 and 2, holding the K/V
blocks and B*H, stop at 65535; at 64 tokens a chunk that would be 4M tokens). The state
passes run on grid (NK, NV, B*H). Accumulators are fp32, and so are the per-chunk
states of fp32 inputs; those of 16-bit inputs are stored in the inputs' dtype, which
is how the output and gradient kernels read them as dot operands anyway. fp16/bf16
operands are fed to ``tl.dot`` in their own dtype with fp32 accumulation, as fla
does. fp32 inputs use IEEE fp32 dots unless ``torch.get_float32_matmul_precision()``
allows TF32, mirroring torch's own matmul.
fp64 inputs are rejected: the dispatcher sends them to the PyTorch path, which
computes in fp64.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from ._precision import dot_precision, upcast_bf16
from .chunk_bwd_kernels import chunk_bwd_dqk_kernel, chunk_bwd_dv_kernel
from .chunk_fwd_kernels import chunk_fwd_o_kernel
from .chunk_h_kernels import chunk_bwd_dh_kernel, chunk_fwd_h_kernel

MIN_CHUNK = 16  # tl.dot needs every dimension >= 16
MAX_CHUNK = 64  # larger tiles only add register pressure


BLOCK_CAP = 64  # largest K or V tile; tests lower it to 16 to exercise several blocks


def tile_width(d: int, cap: int | None = None) -> int:
    """The BK / BV tile for a dimension d: a power of two covering d (at least 16 for
    tl.dot), at most ``cap`` and :data:`BLOCK_CAP`."""
    cap = BLOCK_CAP if cap is None else min(cap, BLOCK_CAP)
    return min(max(16, triton.next_power_of_2(d)), cap)


@dataclass(frozen=True)
class Tiling:
    """Tile caps and warps for one input dtype and dot precision.

    Chosen with the ahead-of-time gate (``benchmarks/aot.py``, ``make gpu-aot``), which
    compiles every launched configuration for sm_90a and sm_80 and refuses spills.
    """

    chunk: int  # largest BT (chunk length)
    block: int  # largest BK / BV
    num_warps: int
    # K tile of the kernels with the most live tiles (dq/dk, hla2's output): each holds
    # several [BT, BT] and [BT, BK] fp32 tiles at once, and spilled 12-304 B at 32
    narrow: int = 16
    # software-pipelining depth of the loops over K/V blocks; fewer stages hold fewer
    # loads in flight, which is what the last few spilled bytes were
    num_stages: int = 3
    narrow_stages: int = 3  # dq/dk's


def tiling(dtype: torch.dtype) -> Tiling:
    """The launch shape for inputs of ``dtype`` (and torch's fp32 matmul precision).

    Measured with the gate (per thread, chunk 64, K = V = 128, every flag on): at
    64-wide K/V tiles and 4 warps the output and gradient kernels spill on both archs,
    0.7-2.5 KB with tensor-core dots (bf16, fp16, TF32; 14-16 KB for bf16 dq/dk on
    sm_80), and IEEE fp32 dots, which have no tensor-core form and become FMA code,
    fall to 32 registers with 2-60 KB of spills. 32-wide tiles and 8 warps halve each
    thread's share of the [BT, BT] and [BT, BK] tiles; IEEE fp32 also needs 32-token
    chunks (dq/dk still spilled 0.2 KB at 64).

    The full matrix (every chunk size, K = V = 32 too) left 4-44 B on sm_80 with 3
    stages: IEEE fp32 at 32-token chunks (output, dv, hla2 state; 1 stage cleans
    sm_80 but leaves 4-12 B on sm_90a, 16-token chunks are clean on both), TF32 at
    64-token chunks (32 is clean) and bf16/fp16 dq/dk at K = 32 (2 stages is clean).
    IEEE fp32 dots are FMA code, so 16-token chunks cost them no tensor-core shape.
    Cleaning the loads of non-finite values (document isolation) added 4-232 B of
    spills to the 16-bit output, dv, dq/dk and hla2-state kernels at 64-token chunks
    with a decay on sm_80; 16-bit inputs therefore use 32-token chunks, as TF32 does.
    """
    if dtype == torch.float32:
        if dot_precision(dtype) == "ieee":
            return Tiling(chunk=16, block=32, num_warps=4)
        return Tiling(chunk=32, block=32, num_warps=8)
    return Tiling(chunk=32, block=32, num_warps=8, narrow_stages=2)


def chunk_tile(chunk_size: int, dtype: torch.dtype | None = None) -> int:
    """The Triton chunk length for a requested ``chunk_size`` (and input ``dtype``).

    The result does not depend on the chunk length (up to rounding), so the kernels
    clamp it to [16, 64] (tl.dot needs 16, larger tiles only cost registers), and to
    the dtype's :func:`tiling` cap.
    """
    cap = MAX_CHUNK if dtype is None else tiling(dtype).chunk
    return min(max(chunk_size, MIN_CHUNK), cap)


def group_sum(x: torch.Tensor, dim: int, G: int) -> torch.Tensor:
    """x with its head axis ``dim`` (query heads, G per kv head) summed per group,
    contiguous: [.., H G, ..] -> [.., H, ..]."""
    if G == 1:
        return x
    return x.unflatten(dim, (-1, G)).sum(dim + 1)


def chunk_states(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    resets: torch.Tensor | None,
    h0: torch.Tensor | None,
    BT: int,
    store_last: bool = True,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """States entering each chunk and the final state (:func:`chunk_fwd_h_kernel`).

    Args:
        k: [B, T, H, K], v: [B, T, H, V], g: [B, T, H] fp32 or None,
        resets: [B, T] int32 or None, h0: [B, H, K, V] fp32 or None.
        dtype: of the per-chunk states; None: k's for 16-bit inputs, else fp32.

    Returns:
        hs: [B, H, N, K, V], the state entering chunk n; h_last: [B, H, K, V] fp32.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    N = triton.cdiv(T, BT)
    tl_ = tiling(k.dtype)
    BK, BV = tile_width(K, tl_.block), tile_width(V, tl_.block)
    hs = torch.empty(B, H, N, K, V, dtype=dtype or state_dtype(k.dtype), device=k.device)
    h_last = torch.empty(B, H, K, V, dtype=torch.float32, device=k.device) if store_last else None
    chunk_fwd_h_kernel[(triton.cdiv(K, BK), triton.cdiv(V, BV), B * H)](
        k, v, g, resets, h0, hs, h_last, T, H, K, V, N,
        BT=BT, BK=BK, BV=BV, HAS_G=g is not None, HAS_R=resets is not None,
        HAS_INIT=h0 is not None, STORE_LAST=store_last, DOT_PREC=dot_precision(k.dtype),
        UPCAST=upcast_bf16(k.dtype), num_warps=tl_.num_warps, num_stages=tl_.num_stages,
    )
    return hs, h_last


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the per-chunk states for inputs of ``dtype``: the inputs' own for
    16-bit inputs (every reader rounds them to it as a dot operand), else fp32."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32


def chunk_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    resets: torch.Tensor | None,
    h0: torch.Tensor | None,
    BT: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward on prepared (contiguous, fp32 g/h0, int32 resets) inputs; q may have G
    times k's heads (multi-query: the states once per kv head, read by its G queries).

    Returns:
        o: [B, T, H G, V] fp32 (the compute dtype, as the torch path), h_last:
        [B, H, K, V] fp32.
    """
    B, T, HQ, K = q.shape
    V = v.shape[-1]
    N = triton.cdiv(T, BT)
    hs, h_last = chunk_states(k, v, g, resets, h0, BT)
    o = torch.empty(B, T, HQ, V, dtype=torch.float32, device=q.device)  # as the torch path
    tl_ = tiling(q.dtype)
    BK, BV = tile_width(K, tl_.block), tile_width(V, tl_.block)
    chunk_fwd_o_kernel[(N, triton.cdiv(V, BV), B * HQ)](
        q, k, v, hs, g, resets, o, T, HQ, K, V, N, HQ // k.shape[2],
        BT=BT, BK=BK, BV=BV, HAS_G=g is not None, HAS_R=resets is not None,
        DOT_PREC=dot_precision(q.dtype), UPCAST=upcast_bf16(q.dtype),
        # a group's separate q and kv offsets spilled 4 B at 4 warps (IEEE fp32, AOT gate)
        num_warps=tl_.num_warps if k.shape[2] == HQ else max(8, tl_.num_warps),
        num_stages=tl_.num_stages,
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
        do: [B, T, H G, V] contiguous, in q's dtype; dht: [B, H, K, V] fp32 or None.

    Returns:
        dq [B, T, H G, K], dk [B, T, H, K], dv [B, T, H, V] in the input dtypes (fp32
        for G > 1: the kernels' per-query-head shares are summed per group in fp32);
        dg [B, T, H] fp32 (None without g); dh0 [B, H, K, V] fp32 (None without h0).
    """
    B, T, HQ, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    G = HQ // H
    N = triton.cdiv(T, BT)
    tl_ = tiling(q.dtype)
    BK, BV = tile_width(K, tl_.block), tile_width(V, tl_.block)
    NK, NV = triton.cdiv(K, BK), triton.cdiv(V, BV)
    HAS_G, HAS_R = g is not None, resets is not None
    prec = dot_precision(q.dtype)
    nw = tl_.num_warps
    # Recompute the states entering each chunk; then their gradients, in reverse.
    hs, _ = chunk_states(k, v, g, resets, h0, BT, store_last=False)
    dhs = torch.empty(B, H, N, K, V, dtype=hs.dtype, device=q.device)
    dh0 = torch.empty(B, H, K, V, dtype=torch.float32, device=q.device) if h0 is not None else None
    chunk_bwd_dh_kernel[(NK, NV, B * H)](
        q, do, g, resets, dht, dhs, dh0, T, HQ, K, V, N, G,
        BT=BT, BK=BK, BV=BV, HAS_G=HAS_G, HAS_R=HAS_R, HAS_FINAL=dht is not None,
        STORE_INIT=h0 is not None, DOT_PREC=prec, UPCAST=upcast_bf16(q.dtype),
        num_warps=nw, num_stages=tl_.num_stages,
    )
    dq = torch.empty_like(q)
    # per query head shares of dk, dv (and dA) for G > 1, summed per group below in fp32
    share = q.new_empty if G == 1 else functools.partial(q.new_empty, dtype=torch.float32)
    dk, dv = share(B, T, HQ, K), share(B, T, HQ, V)
    BKn = tile_width(K, tl_.narrow)  # dq/dk's own K tile, and its number of K blocks
    NKn = triton.cdiv(K, BKn)
    # per K block shares of dg, summed below (one block at K <= the narrow tile)
    dgs = torch.empty(NKn, B, T, HQ, dtype=torch.float32, device=q.device) if HAS_G else None
    chunk_bwd_dv_kernel[(N, NV, B * HQ)](
        q, k, do, dhs, g, resets, dv, T, HQ, K, V, N, G,
        BT=BT, BK=BK, BV=BV, HAS_G=HAS_G, HAS_R=HAS_R, DOT_PREC=prec, UPCAST=upcast_bf16(q.dtype),
        num_warps=nw, num_stages=tl_.num_stages,
    )
    chunk_bwd_dqk_kernel[(N, NKn, B * HQ)](
        q, k, v, do, hs, dhs, g, resets, dq, dk, dgs, T, HQ, K, V, N, G,
        BT=BT, BK=BKn, BV=BV, HAS_G=HAS_G, HAS_R=HAS_R, DOT_PREC=prec, UPCAST=upcast_bf16(q.dtype),
        num_warps=nw, num_stages=tl_.narrow_stages,
    )
    if G > 1:
        dk, dv = group_sum(dk, 2, G).to(k.dtype), group_sum(dv, 2, G).to(v.dtype)
    dg = None
    if dgs is not None:
        dg = group_sum(dgs[0] if NKn == 1 else dgs.sum(0), 2, G)
    return dq, dk, dv, dg, dh0


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    resets: torch.Tensor | None,
    h0: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """Shape and dtype checks, then the layouts the kernels read.

    q, k, v contiguous in one dtype; g and h0 fp32 (their gradients are cast back to
    the callers' dtypes by the autograd glue in :mod:`hla_sp.ops`); resets int32.
    """
    B, T, HQ, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    assert H > 0 and HQ % H == 0, f"k: expected heads dividing q's {HQ}, got {H}"
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


def chunk_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    resets: torch.Tensor | None,
    h0: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The primitive's forward on the kernels, from unprepared inputs (no autograd).

    Args:
        q: [B, T, H, K], already scaled; k: [B, T, H, K]; v: [B, T, H, V]
            (fp32, fp16 or bf16, one dtype). g: [B, T, H] log-decay or None.
        resets: [B, T] bool or None. h0: [B, H, K, V] or None.
        chunk_size: requested chunk length, clamped to [16, 64] and the dtype's cap
            (:func:`chunk_tile`).

    Returns:
        o [B, T, H, V] and h_last [B, H, K, V], both fp32 (the compute dtype).
    """
    qp, kp, vp, gp, rp, hp = prepare(q, k, v, g, resets, h0)
    return chunk_fwd(qp, kp, vp, gp, rp, hp, chunk_tile(chunk_size, qp.dtype))


def chunk_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    resets: torch.Tensor | None,
    h0: torch.Tensor | None,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of :func:`chunk_forward` given do [B, T, H, V] and dht [B, H, K, V] or None.

    Returns:
        dq, dk [B, T, H, K], dv [B, T, H, V] in the input dtype; dg [B, T, H] and
        dh0 [B, H, K, V] fp32, None where g or h0 is None.
    """
    qp, kp, vp, gp, rp, hp = prepare(q, k, v, g, resets, h0)
    # do meets v in a dot, so it takes the input dtype (o itself is fp32); a non-finite
    # dh_T is cleaned here (d_last reads it outside the kernels), its poison flagged by
    # the caller
    dhp = None if dht is None else torch.nan_to_num(dht.float(), nan=0.0, posinf=0.0, neginf=0.0)
    return chunk_bwd(
        qp, kp, vp, gp, rp, hp, do.to(qp.dtype).contiguous(),
        None if dhp is None else dhp.contiguous(), chunk_tile(chunk_size, qp.dtype),
    )

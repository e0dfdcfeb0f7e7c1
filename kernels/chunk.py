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
:func:`hla_sp.kernels._round.finite`). Given flags, the state passes raise them for
the non-finite rows they read (:mod:`hla_sp.kernels._flags`) and one gated launch
per direction puts the poison back (:mod:`hla_sp.kernels.poison`); finite inputs pay
a word read per (batch, head) for it.

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

import torch
import triton

from ._precision import dot_precision, upcast_bf16
from ._tiles import Config, primitive_chunk, tuned
from .chunk_bwd_kernels import chunk_bwd_dqk_kernel, chunk_bwd_dv_kernel
from .chunk_fwd_kernels import chunk_fwd_o_kernel
from .chunk_h_kernels import chunk_bwd_dh_kernel, chunk_fwd_h_kernel
from .poison import new_flags, poison_backward, poison_forward


def group_sum(x: torch.Tensor, dim: int, G: int) -> torch.Tensor:
    """x with its head axis ``dim`` (query heads, G per kv head) summed per group,
    contiguous: [.., H G, ..] -> [.., H, ..]."""
    if G == 1:
        return x
    return x.unflatten(dim, (-1, G)).sum(dim + 1)


def _flags(q: torch.Tensor, g: torch.Tensor | None, resets: torch.Tensor | None) -> dict:
    """The constexpr flags every kernel of a call shares."""
    return dict(HAS_G=g is not None, HAS_R=resets is not None,
                DOT_PREC=dot_precision(q.dtype), UPCAST=upcast_bf16(q.dtype))


def _key(*tensors: torch.Tensor | None, **extra: object) -> tuple:
    """The tuning key of a launch: which optional inputs are present, the dtypes and
    the constexprs that change the code (the dims are added by :func:`tuned`)."""
    return (*(None if t is None else t.dtype for t in tensors), *sorted(extra.items()))


def chunk_states(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    resets: torch.Tensor | None,
    h0: torch.Tensor | None,
    BT: int,
    store_last: bool = True,
    dtype: torch.dtype | None = None,
    fl: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """States entering each chunk and the final state (:func:`chunk_fwd_h_kernel`).

    Args:
        k: [B, T, H, K], v: [B, T, H, V], g: [B, T, H] fp32 or None,
        resets: [B, T] int32 or None, h0: [B, H, K, V] fp32 or None.
        dtype: of the per-chunk states; None: :func:`state_dtype`.
        fl: zeroed flags [B, T + 2, H] int32 that the pass raises for the non-finite
            k, v, decay and h0 it reads (:mod:`hla_sp.kernels._flags`), or None.

    Returns:
        hs: [B, H, N, K, V], the state entering chunk n; h_last: [B, H, K, V] fp32.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    N = triton.cdiv(T, BT)
    hs = torch.empty(B, H, N, K, V, dtype=dtype or state_dtype(k.dtype), device=k.device)
    h_last = torch.empty(B, H, K, V, dtype=torch.float32, device=k.device) if store_last else None

    def launch(c: Config) -> None:
        chunk_fwd_h_kernel[(triton.cdiv(K, c.BK), triton.cdiv(V, c.BV), B * H)](
            k, v, g, resets, h0, hs, h_last, fl, T, H, K, V, N,
            BT=BT, BK=c.BK, BV=c.BV, HAS_INIT=h0 is not None, STORE_LAST=store_last,
            FLAG=fl is not None, **_flags(k, g, resets), num_warps=c.num_warps,
            num_stages=c.num_stages,
        )

    tuned("state", _key(k, hs, g, resets, h0, fl, BT=BT, last=store_last), k.dtype, K, V,
          launch)
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
    out_dtype: torch.dtype | None = None,
    fl: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward on prepared (contiguous, fp32 g/h0, int32 resets) inputs; q may have G
    times k's heads (multi-query: the states once per kv head, read by its G queries).

    With zeroed flags ``fl`` [B, T + 2, H] the state pass raises them and the poison of
    non-finite inputs is put back in o and h_last (:mod:`hla_sp.kernels.poison`). q's
    ``scale`` multiplies the fp32 products of q (as fla does): no scaled copy of q is
    made, nor held in registers, and q is rounded once, as it came.

    Returns:
        o: [B, T, H G, V] in ``out_dtype`` (default q's: rounded once, at the store,
        with no cast pass after), h_last: [B, H, K, V] fp32.
    """
    B, T, HQ, K = q.shape
    V = v.shape[-1]
    N, G = triton.cdiv(T, BT), HQ // k.shape[2]
    hs, h_last = chunk_states(k, v, g, resets, h0, BT, fl=fl)
    o = torch.empty(B, T, HQ, V, dtype=out_dtype or q.dtype, device=q.device)

    def launch(c: Config) -> None:
        chunk_fwd_o_kernel[(N, triton.cdiv(V, c.BV), B * HQ)](
            q, k, v, hs, g, resets, o, float(scale), T, HQ, K, V, N, G,
            BT=BT, BK=c.BK, BV=c.BV, **_flags(q, g, resets),
            num_warps=c.num_warps, num_stages=c.num_stages,
        )

    tuned("out", _key(q, hs, o, g, resets, BT=BT, G=G), q.dtype, K, V, launch)
    assert h_last is not None
    if fl is not None:
        poison_forward(fl, g, resets, o, h_last)
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
    ff: torch.Tensor | None = None,
    scale: float = 1.0,
    v_is_k: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None,
           torch.Tensor | None]:
    """Backward on prepared inputs; the chunk states are recomputed, not saved.

    Args:
        do: [B, T, H G, V] contiguous, in q's dtype; dht: [B, H, K, V] fp32 or None
            (read clean: NaN and ±inf as 0).
        ff: the forward's flags [B, T + 2, H]; given, the backward raises its own and
            puts the poison back in every gradient (:mod:`hla_sp.kernels.poison`).
        scale: q's, as in :func:`chunk_fwd`; dq is the gradient of the unscaled q.
        v_is_k: v is k (the key moment S = sum k k^T): k's two gradients are summed in
            the dq/dk kernel's epilogue, in fp32, and dk is their sum.

    Returns:
        dq [B, T, H G, K], dk [B, T, H, K], dv [B, T, H, V] (None when ``v_is_k``) in
        the input dtypes; dg [B, T, H] fp32 (None without g); dh0 [B, H, K, V] fp32
        (None without h0).
    """
    B, T, HQ, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    G = HQ // H
    N = triton.cdiv(T, BT)
    flags = _flags(q, g, resets)
    # Recompute the states entering each chunk; then their gradients, in reverse.
    hs, _ = chunk_states(k, v, g, resets, h0, BT, store_last=False)
    dhs = torch.empty(B, H, N, K, V, dtype=hs.dtype, device=q.device)
    dh0 = torch.empty(B, H, K, V, dtype=torch.float32, device=q.device) if h0 is not None else None
    fb = None if ff is None else new_flags(B, T, H, q.device)

    def launch_dh(c: Config) -> None:
        chunk_bwd_dh_kernel[(triton.cdiv(K, c.BK), triton.cdiv(V, c.BV), B * H)](
            q, do, g, resets, dht, dhs, dh0, fb, float(scale), T, HQ, K, V, N, G,
            BT=BT, BK=c.BK, BV=c.BV, HAS_FINAL=dht is not None, STORE_INIT=h0 is not None,
            FLAG=fb is not None, **flags, num_warps=c.num_warps, num_stages=c.num_stages,
        )

    tuned("state", _key(q, dhs, g, resets, dht, h0, fb, BT=BT, G=G, bwd=True), q.dtype, K, V,
          launch_dh)
    dq = torch.empty_like(q)
    # per query head shares of dk, dv for G > 1, summed per group below in fp32; a dv
    # that the dq/dk kernel adds into dk (v_is_k) is kept in fp32 too: one rounding
    f32 = functools.partial(q.new_empty, dtype=torch.float32)
    dk = q.new_empty(B, T, HQ, K) if G == 1 else f32(B, T, HQ, K)
    dv = q.new_empty(B, T, HQ, V) if G == 1 and not v_is_k else f32(B, T, HQ, V)

    def launch_dv(c: Config) -> None:
        chunk_bwd_dv_kernel[(N, triton.cdiv(V, c.BV), B * HQ)](
            q, k, do, dhs, g, resets, dv, float(scale), T, HQ, K, V, N, G,
            BT=BT, BK=c.BK, BV=c.BV, **flags, num_warps=c.num_warps, num_stages=c.num_stages,
        )

    def launch_dqk(c: Config) -> torch.Tensor | None:
        NK = triton.cdiv(K, c.BK)
        # per K block shares of dg, summed below (one block when BK covers K)
        dgs = torch.empty(NK, B, T, HQ, dtype=torch.float32, device=q.device) if g is not None \
            else None
        chunk_bwd_dqk_kernel[(N, NK, B * HQ)](
            q, k, v, do, hs, dhs, g, resets, dq, dk, dgs, dv if v_is_k else None, float(scale),
            T, HQ, K, V, N, G, BT=BT, BK=c.BK, BV=c.BV, ADD_DV=v_is_k, **flags,
            num_warps=c.num_warps, num_stages=c.num_stages,
        )
        return dgs

    tuned("out", _key(q, dhs, dv, g, resets, BT=BT, G=G, dv=True), q.dtype, K, V, launch_dv)
    dgs = tuned("dqk", _key(q, hs, dq, dk, g, resets, BT=BT, G=G, v_is_k=v_is_k), q.dtype, K, V,
                launch_dqk)
    if v_is_k:
        dv = None  # summed into dk
    if G > 1:
        dk = group_sum(dk, 2, G).to(k.dtype)
        dv = None if dv is None else group_sum(dv, 2, G).to(v.dtype)
    dg = None
    if dgs is not None:
        dg = group_sum(dgs[0] if dgs.shape[0] == 1 else dgs.sum(0), 2, G)
    if ff is not None:
        assert fb is not None
        poison_backward(ff, fb, g, resets, dq, dk, dk if dv is None else dv, dg, dh0)
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
    flags: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The primitive's forward on the kernels, from unprepared inputs (no autograd).

    Args:
        q: [B, T, H G, K], scaled by ``scale`` in the kernels; k: [B, T, H, K]; v: [B, T, H, V]
            (fp32, fp16 or bf16, one dtype). g: [B, T, H] log-decay or None.
        resets: [B, T] bool or None. h0: [B, H, K, V] or None.
        chunk_size: requested chunk length, clamped to [16, 64] (:func:`primitive_chunk`).
        flags: zeroed flags [B, T + 2, H] int32 (:func:`new_flags`) to run with document
            isolation: they are raised for the non-finite inputs and the poison is put
            back (:mod:`hla_sp.kernels.poison`); :func:`chunk_backward` takes them.

    Returns:
        o [B, T, H G, V] in the inputs' dtype and h_last [B, H, K, V] fp32.
    """
    qp, kp, vp, gp, rp, hp = prepare(q, k, v, g, resets, h0)
    return chunk_fwd(qp, kp, vp, gp, rp, hp, primitive_chunk(chunk_size, qp.dtype), fl=flags,
                     scale=scale)


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
    flags: torch.Tensor | None = None,
    scale: float = 1.0,
    v_is_k: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None,
           torch.Tensor | None]:
    """Gradients of :func:`chunk_forward` given do [B, T, H G, V], dht [B, H, K, V] or None
    and the forward's ``flags`` (None: no isolation; the gradients of finite inputs are
    the same either way); with ``v_is_k`` (v is k) dk holds both of k's gradients and dv
    is None (:func:`chunk_bwd`).

    Returns:
        dq, dk [B, T, H, K], dv [B, T, H, V] in the input dtype; dg [B, T, H] and
        dh0 [B, H, K, V] fp32, None where g or h0 is None.
    """
    qp, kp, vp, gp, rp, hp = prepare(q, k, v, g, resets, h0)
    # do meets v in a dot, so it takes the input dtype (o's, a no-op then); dh_T is read
    # clean by the kernel, and flagged there
    return chunk_bwd(
        qp, kp, vp, gp, rp, hp, do.to(qp.dtype).contiguous(),
        None if dht is None else dht.float().contiguous(),
        primitive_chunk(chunk_size, qp.dtype), ff=flags, scale=scale, v_is_k=v_is_k,
    )

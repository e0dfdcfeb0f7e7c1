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
  buffers, but only B*H*ceil(V/BV) programs and a K x K fp32 state per program. Its
  chunk is 16 tokens; the configurations measured ahead of time to spill more than
  1 KiB per thread are refused (:func:`sequential_refusal`).
- ``mode="chunked"`` (the default): chunk-parallel like the primitive. S_in comes
  from the primitive's state kernels (values = k); :func:`hla2_state_kernel`
  rebuilds k~ per chunk and writes only the chunk's stage-2 state; the state passing
  gives H_in; :func:`hla2_fwd_o_kernel` rebuilds k~ again and writes o. k~ is
  computed twice on chip instead of being stored once and read twice.

Whether either beats the two-stage composition is a GPU measurement
(benchmarks/gpu_check.sh times both); until then this is opt-in through
:func:`hla_sp.ops.hla2_fused`; the default ``hla_sp.hla2`` stays the composition.

The backward recomputes k~ with the primitive's forward kernels, then runs the
primitive's backward kernels for stage 2 and for stage 1 (k~ exists only during the
backward) and adds the pieces: dq = dq1 + dq2 + ridge dk~, dk = dk1 + dv1 (k is both
key and value of stage 1), dg = dg1 + dg2.
"""

from __future__ import annotations

import torch
import triton

from ._precision import dot_precision, upcast_bf16
from ._tiles import SPILL_LIMIT, chunk_tile, tile_width, tiling
from .chunk import chunk_bwd, chunk_fwd, chunk_states, prepare
from .hla2_fused_kernels import (
    fused_hla2_fwd_kernel,
    hla2_fwd_o_kernel,
    hla2_state_kernel,
    state_passing_kernel,
)

MAX_FUSED_K = 128  # the sequential program holds a K x K fp32 state
# fp32 operands double the K x K tiles the sequential program stages in shared memory:
# at K = 128 it asks for 246,272 B (IEEE) or 295,424 B (TF32), over every arch's limit
MAX_FUSED_K_FP32 = 64
MODES = ("chunked", "sequential")

# --------------------------------------------------------------------------- sequential

# Its own chunk, whatever the chunk_size (the result does not depend on it up to
# rounding): the [BT, BK] tiles of a chunk sit beside the K x K state, and 32-token
# chunks spilled 14 KB per thread at K = 128 on sm_80 (bf16, decay, documents), 16-token
# ones 0.5 KB (benchmarks/aot.py)
SEQUENTIAL_BT = 16
SEQUENTIAL_BV = 32  # the V tile's cap (tile_width also caps it by BLOCK_CAP)

# (inputs, BK, BV, decay, documents, states) -> {arch: bytes spilled per thread (the
# larger of ptxas's spill stores and loads)}: configurations of the sequential kernel
# measured ahead of time for sm_80 and sm_90a by `python benchmarks/aot_sequential.py`,
# which prints this table (tests/unit/benchmarks/test_aot.py checks it is current). Inputs: "fp32"
# (IEEE dots), "tf32", "bf16", "fp16". The launcher refuses those over SPILL_LIMIT on
# either arch; `--all` measures the configurations not listed yet.
SequentialKey = tuple[str, int, int, bool, bool, bool]
SEQUENTIAL_MEASURED: dict[SequentialKey, dict[str, int]] = {
    ("bf16", 128, 32, False, False, False): {"sm_80": 248, "sm_90a": 28},
    ("bf16", 128, 32, True, False, False): {"sm_80": 532, "sm_90a": 72},
    ("bf16", 128, 32, True, False, True): {"sm_80": 1212, "sm_90a": 604},  # refused
    ("bf16", 128, 32, True, True, False): {"sm_80": 540, "sm_90a": 88},
    ("fp16", 128, 32, False, False, False): {"sm_80": 192, "sm_90a": 28},
    ("fp16", 128, 32, True, False, True): {"sm_80": 1172, "sm_90a": 604},  # refused
    ("fp32", 32, 32, True, False, False): {"sm_80": 8, "sm_90a": 92},
    ("fp32", 32, 32, True, True, False): {"sm_80": 16, "sm_90a": 68},
    ("fp32", 64, 32, True, False, True): {"sm_80": 216, "sm_90a": 276},
    ("fp32", 64, 32, True, True, False): {"sm_80": 56, "sm_90a": 88},
    ("tf32", 64, 32, True, True, False): {"sm_80": 60, "sm_90a": 0},
}


def sequential_tiles(K: int, V: int) -> tuple[int, int, int, int, int]:
    """(BT, BK, BV, num_warps, num_stages) of the sequential kernel for K and V.

    BK covers all of K (the program holds the whole K x K state); BV is the primitive's
    V tile. A program holds S [BK, BK] and H [BK, BV] in fp32: from BK = 64, 8 warps
    and one pipeline stage (measured: IEEE fp32 at BK = 64 with 4 warps fell to 32
    registers and 8.9 KB of spills, 56 B with 8; at BK = 128, 16 warps let ptxas fall
    to 32-64 registers with 4-7 KB of spills on sm_80; 1 and 2 stages spill alike).
    """
    BK = max(16, triton.next_power_of_2(K))
    wide = BK >= 64
    return SEQUENTIAL_BT, BK, tile_width(V, SEQUENTIAL_BV), 8 if wide else 4, 1 if wide else 3


def sequential_key(
    dtype: torch.dtype, K: int, V: int, decay: bool, documents: bool, states: bool
) -> SequentialKey:
    """The key of :data:`SEQUENTIAL_MEASURED` for one call: what picks the kernel."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    name = names.get(dtype, str(dtype))
    if dot_precision(dtype) == "tf32":
        name = "tf32"
    _, BK, BV, _, _ = sequential_tiles(K, V)
    return (name, BK, BV, bool(decay), bool(documents), bool(states))


def sequential_refusal(
    dtype: torch.dtype, K: int, V: int, decay: bool, documents: bool, states: bool
) -> str | None:
    """Why the sequential kernel refuses a call (K, shared memory, spills), or None.

    Args: the inputs' dtype, K and V as the kernel sees them (V + 1 with ``normalize``:
    the denominator's column), and whether a decay, documents (``cu_seqlens``) and
    initial states are given. Decided without a GPU, from :data:`SEQUENTIAL_MEASURED`.
    """
    head = "hla2_fused(mode=\"sequential\")"
    if K > MAX_FUSED_K:
        return f"{head}: expected K <= {MAX_FUSED_K}, got K = {K}; use mode=\"chunked\""
    key = sequential_key(dtype, K, V, decay, documents, states)
    name, BK = key[0], key[1]
    if BK > MAX_FUSED_K_FP32 and dtype == torch.float32:
        return (
            f"{head}: fp32 inputs need K <= {MAX_FUSED_K_FP32}, got K = {K}: the {BK} x {BK} "
            "state tiles ask for more shared memory than a block may use (246 KB IEEE, "
            "295 KB TF32; sm_90 allows 227 KB, sm_80 163 KB). Use mode=\"chunked\" (the "
            "default), or bf16/fp16 inputs."
        )
    what = (f"{head}: {name} inputs with K = {K}, V = {V}, decay={key[3]}, "
            f"documents={key[4]}, initial states={key[5]}")
    spills = SEQUENTIAL_MEASURED.get(key)
    if spills is None:
        # Not measured: refused when it has every input of a measured configuration over
        # the limit (a decay, documents or states only add registers), else admitted.
        over = [k for k, v in SEQUENTIAL_MEASURED.items() if k[:3] == key[:3]
                and all(b >= a for a, b in zip(k[3:], key[3:]))
                and max(v.values()) > SPILL_LIMIT]
        if not over:
            return None
        spills, key = SEQUENTIAL_MEASURED[over[0]], over[0]
        what += (f" (not measured; it has every input of decay={key[3]}, documents="
                 f"{key[4]}, initial states={key[5]}, which was)")
    if max(spills.values(), default=0) <= SPILL_LIMIT:
        return None
    where = ", ".join(f"{b} B on {arch}" for arch, b in sorted(spills.items()))
    return (
        f"{what}: its kernel would spill {where} per thread, over the {SPILL_LIMIT} B "
        "limit (measured ahead of time for sm_80 and sm_90a by "
        "benchmarks/aot_sequential.py); use mode=\"chunked\" (the default)."
    )


def launch_sequential(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    resets: torch.Tensor | None,
    S0: torch.Tensor | None,
    H0: torch.Tensor | None,
    ridge: float,
    o: torch.Tensor,
    flags: dict[str, object],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run :func:`fused_hla2_fwd_kernel` into o [B, T, H, V]; returns o, S_T, H_T (fp32).

    Inputs prepared, as for :func:`fused_hla2_fwd`; no refusal here (the AOT gate
    captures every configuration through this function, refused ones included).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT, BK, BV, num_warps, num_stages = sequential_tiles(K, V)
    S_T = torch.empty(B, H, K, K, dtype=torch.float32, device=q.device)
    H_T = torch.empty(B, H, K, V, dtype=torch.float32, device=q.device)
    fused_hla2_fwd_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, v, g, resets, S0, H0, o, S_T, H_T, float(ridge), T, H, K, V,
        triton.cdiv(T, BT), BT=BT, BK=BK, BV=BV, HAS_S0=S0 is not None,
        HAS_H0=H0 is not None, **flags, num_warps=num_warps, num_stages=num_stages,
    )
    return o, S_T, H_T


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
        DOT_PREC=dot_precision(q.dtype), UPCAST=upcast_bf16(q.dtype),
    )
    tl_ = tiling(q.dtype)
    if mode == "chunked":
        BK, BV = tile_width(K, tl_.block), tile_width(V, tl_.block)
        NK, NV = triton.cdiv(K, BK), triton.cdiv(V, BV)
        # stage-1 states entering each chunk, fp32 (the kernels below read them so)
        Ss, S_T = chunk_states(k, k, g, resets, S0, BT, dtype=torch.float32)
        hs = torch.empty(B, H, N, K, V, dtype=torch.float32, device=q.device)
        hla2_state_kernel[(N, NK * NV, B * H)](
            q, k, v, Ss, g, resets, hs, float(ridge), T, H, K, V, N,
            BT=BT, BK=BK, BV=BV, **flags, num_warps=tl_.num_warps, num_stages=tl_.num_stages,
        )
        H_T = torch.empty(B, H, K, V, dtype=torch.float32, device=q.device)
        state_passing(hs, g, resets, H0, H_T, T, BT)
        hla2_fwd_o_kernel[(N, NV, B * H)](
            q, k, v, Ss, hs, g, resets, o, float(ridge), T, H, K, V, N,
            BT=BT, BK=tile_width(K, tl_.narrow), BV=BV, **flags, num_warps=tl_.num_warps,
            num_stages=tl_.num_stages,
        )
        assert S_T is not None
        return o, S_T, H_T
    if mode != "sequential":
        raise ValueError(f"fused hla2: mode must be one of {MODES}, got {mode!r}")
    refusal = sequential_refusal(q.dtype, K, V, decay=g is not None,
                                 documents=resets is not None,
                                 states=S0 is not None or H0 is not None)
    if refusal is not None:
        raise ValueError(refusal)
    return launch_sequential(q, k, v, g, resets, S0, H0, ridge, o, flags)


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
    kt, _ = chunk_fwd(q, k, k, g, resets, S0, BT, torch.float32)  # stage 1 output
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



def state_passing(
    hs: torch.Tensor,
    g: torch.Tensor | None,
    resets: torch.Tensor | None,
    h_init: torch.Tensor | None,
    h_last: torch.Tensor | None,
    T: int,
    BT: int,
) -> None:
    """Launch :func:`state_passing_kernel` on the stage-2 chunk summands hs
    [B, H, N, DX, DY] fp32 (in place: afterwards the states entering each chunk).

    No dot here, so the state is cut into 32 x 32 blocks: a sequential loop over the
    chunks is latency bound, and more programs per head hide more of it.
    """
    B, H, N, DX, DY = hs.shape
    BX, BY = tile_width(DX, 32), tile_width(DY, 32)
    state_passing_kernel[(triton.cdiv(DX, BX) * triton.cdiv(DY, BY), B * H)](
        hs, g, resets, h_init, h_last, T, H, DX, DY, N,
        BT=BT, BX=BX, BY=BY, REVERSE=False, HAS_G=g is not None, HAS_R=resets is not None,
        HAS_INIT=h_init is not None, STORE_LAST=h_last is not None,
    )


def fused_hla2_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    resets: torch.Tensor | None,
    S0: torch.Tensor | None,
    H0: torch.Tensor | None,
    ridge: float,
    chunk_size: int,
    mode: str = "chunked",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hla2 of already-scaled q on the fused kernels, from unprepared inputs (no autograd).

    Args:
        q: [B, T, H, K] scaled; k: [B, T, H, K]; v: [B, T, H, V] (fp32/fp16/bf16).
        g: [B, T, H] log-decay or None; resets: [B, T] bool or None.
        S0: [B, H, K, K], H0: [B, H, K, V] initial states or None.
        mode: "chunked" (chunk-parallel) or "sequential" (one program walks the chunks).

    Returns:
        o [B, T, H, V], S_T [B, H, K, K] and H_T [B, H, K, V], all fp32.
    """
    if mode not in MODES:
        raise ValueError(f"fused hla2: mode must be one of {MODES}, got {mode!r}")
    q, k, v, g, resets, H0 = prepare(q, k, v, g, resets, H0)
    if S0 is not None:
        K = q.shape[-1]
        assert S0.shape == (q.shape[0], q.shape[2], K, K), f"S0: got {tuple(S0.shape)}"
        S0 = S0.float().contiguous()
    BT = chunk_tile(chunk_size, q.dtype)
    return fused_hla2_fwd(q, k, v, g, resets, S0, H0, float(ridge), BT, mode)


def fused_hla2_backward(
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
    chunk_size: int,
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of :func:`fused_hla2_forward` given do [B, T, H, V], dS_T, dH_T (or None).

    Returns dq, dk, dv (input dtypes), dg (fp32 or None), dS0, dH0 (fp32 or None).
    """
    q, k, v, g, resets, H0 = prepare(q, k, v, g, resets, H0)
    if S0 is not None:
        S0 = S0.float().contiguous()
    return fused_hla2_bwd(
        q, k, v, g, resets, S0, H0, float(ridge), do.to(q.dtype).contiguous(),
        None if dS_T is None else dS_T.float().contiguous(),
        None if dH_T is None else dH_T.float().contiguous(), chunk_tile(chunk_size, q.dtype),
    )

"""Tiles and launch configurations of the kernels, and the choice among them by time.

The primitive's kernels (:mod:`hla_sp.kernels.chunk`) run 64-token chunks with
tensor-core dots, 32 with IEEE fp32 ones (:func:`primitive_chunk`), and have a few
candidate configurations each (:data:`CANDIDATES`: K/V tile caps, warps, pipeline
stages), as fla's autotuned kernels do. Candidates differ by input class: "mma"
(bf16, fp16, TF32: tensor-core dots, BK and BV up to 128 so that sm_90 can use
wgmma) and "fma" (IEEE fp32, whose dots are FMA code: every [BT, BK] tile costs
registers, so narrower tiles).

:func:`tuned` launches one kernel: on a GPU the first call for a key (the kernel, the
dtypes, K, V, BT, the group size and the flags) times every candidate and keeps the
fastest; later calls launch it with no timing. Every candidate writes the whole of its
outputs (no kernel accumulates into memory), so timing runs are harmless. Under the
interpreter the first candidate runs (its time means nothing); under
:func:`hla_sp.kernels._jit.capture` with ``every=True`` every candidate is described,
which is how the ahead-of-time gate (``benchmarks/aot.py``) compiles all of them.

The fused hla2's kernels keep one shape per dtype (:func:`tiling`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton

from . import _jit
from ._precision import dot_precision

SPILL_LIMIT = 1024  # bytes per thread a configuration may spill (benchmarks/aot.py's gate)
MIN_CHUNK = 16  # tl.dot needs every dimension >= 16
MAX_CHUNK = 64  # larger tiles only add register pressure


BLOCK_CAP = 128  # largest K or V tile; tests lower it to 16 to exercise several blocks


def tile_width(d: int, cap: int | None = None) -> int:
    """The BK / BV tile for a dimension d: a power of two covering d (at least 16 for
    tl.dot), at most ``cap`` and :data:`BLOCK_CAP`."""
    cap = BLOCK_CAP if cap is None else min(cap, BLOCK_CAP)
    return min(max(16, triton.next_power_of_2(d)), cap)


@dataclass(frozen=True)
class Tiling:
    """Tile caps and warps of the fused hla2's kernels for one input dtype and dot
    precision (the primitive's are :data:`CANDIDATES`).

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
    """The fused hla2's launch shape for inputs of ``dtype`` (and torch's fp32 matmul
    precision).

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
    """The fused hla2's chunk length for a requested ``chunk_size`` (and input ``dtype``).

    The result does not depend on the chunk length (up to rounding), so the kernels
    clamp it to [16, 64] (tl.dot needs 16, larger tiles only cost registers), and to
    the dtype's :func:`tiling` cap.
    """
    cap = MAX_CHUNK if dtype is None else tiling(dtype).chunk
    return min(max(chunk_size, MIN_CHUNK), cap)


def primitive_chunk(chunk_size: int, dtype: torch.dtype) -> int:
    """The primitive's chunk length for a requested ``chunk_size``: clamped to [16, 64]
    (tl.dot needs 16; the result does not depend on it up to rounding, and 64 is fla's
    choice: [64, 64] score tiles, 64-row dots for the tensor cores). IEEE fp32 dots are
    FMA code, whose [BT, BT] tiles live in registers: 64-token chunks spilled 5 KB per
    thread on sm_80 (ahead-of-time gate), so those take 32."""
    cap = MAX_CHUNK if _kind(dtype) == "mma" else 32
    return min(max(chunk_size, MIN_CHUNK), cap)


def _kind(dtype: torch.dtype) -> str:
    """"fma" for IEEE fp32 dots, "mma" for tensor-core ones (bf16, fp16, TF32)."""
    return "fma" if dtype == torch.float32 and dot_precision(dtype) == "ieee" else "mma"


@dataclass(frozen=True)
class Config:
    """One launch configuration: K and V tile caps, warps, pipeline stages; ``archs``
    the compute capabilities (90: sm_90) it is a candidate on, () every one."""

    BK: int
    BV: int
    num_warps: int
    num_stages: int
    archs: tuple[int, ...] = ()


SM90 = (90,)  # Hopper: wgmma keeps its accumulators out of the general registers
# role -> input class -> candidates, the first the default (the interpreter's). Roles:
# "state" the state passes (grid NK x NV x B H, a loop over the chunks), "out" the
# output and dv kernels (grid N x NV x B H, a loop over K blocks), "dqk" the dq/dk/dg
# kernel (grid N x NK x B H, a loop over V blocks; it holds the most tiles). Each
# passed the gate (<= 1 KiB of spill per thread, chunk 64, K = V = 128, every flag) on
# sm_90a and sm_80, or on sm_90a alone for those marked SM90, which sm_80 spills
# (bf16: out at 128 x 64 10 KB, dq/dk at 64 x 64 4.8 KB).
# Smaller tiles give a state pass more programs (B H NK NV) where B H is small; wider
# ones hold a chunk's [BT, BT] score tile for more of K or V (recomputed once per
# block). Measured and dropped: out at 64 x 64 with 4 warps (bf16: 1.1-2 KB on sm_80),
# dq/dk at 32 x 64 and 32 x 32 with 4 warps (1.1-2.2 KB on sm_80) and at 32 x 128
# (TF32: 1.2 KB on sm_90a, bf16 13 KB on sm_80), state at 128 x 128 (2 KB on sm_80;
# one program per head), and IEEE fp32 at 64-token chunks (5 KB).
CANDIDATES: dict[str, dict[str, list[Config]]] = {
    "state": {"mma": [Config(64, 64, 4, 2), Config(128, 64, 8, 2), Config(64, 64, 8, 2),
                      Config(32, 64, 4, 2)],
              "fma": [Config(32, 32, 4, 2)]},
    "out": {"mma": [Config(64, 64, 8, 2), Config(64, 128, 8, 2), Config(32, 64, 4, 2),
                    Config(128, 64, 8, 2, SM90)],
            "fma": [Config(32, 32, 8, 2), Config(32, 32, 4, 2)]},
    "dqk": {"mma": [Config(32, 64, 8, 2), Config(64, 64, 8, 2, SM90)],
            "fma": [Config(16, 32, 8, 2), Config(16, 32, 4, 2)]},
}


def candidates(role: str, dtype: torch.dtype, K: int, V: int,
               arch: int | None = None) -> list[Config]:
    """The distinct configurations of ``role`` for inputs of ``dtype`` at K and V, the
    tiles resolved (:func:`tile_width`): those for every arch and, on compute capability
    ``arch`` (90: sm_90), its own; with ``arch`` None all of them (the gate's)."""
    out: list[Config] = []
    for c in CANDIDATES[role][_kind(dtype)]:
        if arch is not None and c.archs and arch not in c.archs:
            continue
        r = Config(tile_width(K, c.BK), tile_width(V, c.BV), c.num_warps, c.num_stages,
                   c.archs)
        # one of every launch shape, the most general kept (listed first)
        if all((r.BK, r.BV, r.num_warps, r.num_stages)
               != (o.BK, o.BV, o.num_warps, o.num_stages) for o in out):
            out.append(r)
    return out


_CHOSEN: dict[tuple[Any, ...], Config] = {}


def tuned(role: str, key: tuple[Any, ...], dtype: torch.dtype, K: int, V: int,
          launch: Callable[[Config], Any]) -> Any:
    """``launch(config)`` with the configuration of ``role`` chosen for ``key``; what the
    chosen launch returns (its outputs)."""
    every = _jit.capturing_every()
    if every is not None:  # described, not run: the gate wants every candidate
        cands = candidates(role, dtype, K, V)
        for c in cands[1:] if every else []:
            with _jit.for_archs(c.archs):
                launch(c)
        return launch(cands[0])
    if _jit.interpreting():
        return launch(candidates(role, dtype, K, V)[0])
    arch = _device_arch()
    cands = candidates(role, dtype, K, V, arch)
    if len(cands) == 1:
        return launch(cands[0])
    full = (role, dtype, K, V, arch, *key)
    if full not in _CHOSEN:
        _CHOSEN[full] = min(cands, key=lambda c: _time(lambda: launch(c)))
    return launch(_CHOSEN[full])


def chosen() -> list[dict[str, Any]]:
    """What the tuner chose so far in this process, one row per key: the role, the
    dtype, K, V, the arch, the rest of the key as text, and the winning configuration
    (for a benchmark's record of which tiles won)."""
    rows = []
    for (role, dtype, K, V, arch, *key), c in _CHOSEN.items():
        rows.append(dict(role=role, dtype=str(dtype).removeprefix("torch."), K=K, V=V,
                         arch=arch, key=" ".join(map(str, key)), BK=c.BK, BV=c.BV,
                         num_warps=c.num_warps, num_stages=c.num_stages))
    return rows


def _device_arch() -> int:
    """The current CUDA device's compute capability as 10 major + minor (90: sm_90),
    read on a GPU launch only (imports query no driver)."""
    index = torch.cuda.current_device()
    if index not in _ARCH:
        major, minor = torch.cuda.get_device_capability(index)
        _ARCH[index] = 10 * major + minor
    return _ARCH[index]


_ARCH: dict[int, int] = {}


def _time(run: Callable[[], Any], reps: int = 3) -> float:
    """Milliseconds of ``reps`` runs after one warm-up (which compiles), on the GPU."""
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)

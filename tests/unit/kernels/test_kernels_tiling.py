"""Launch shapes chosen by the ahead-of-time gate (``benchmarks/aot.py``), checked on CPU.

The gate itself (tests/unit/benchmarks/test_aot.py) compiles them; here: the tiling rules and the
refusal of the one configuration that cannot fit (sequential fused hla2, fp32, K=128).
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from hla_sp.ops import hla2_fused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    import hla_sp.kernels as kernels

    return kernels


def test_tiling_per_dtype_and_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """32-wide K/V tiles everywhere. IEEE fp32 (FMA dots): 16-token chunks and 4 warps;
    TF32: 32-token chunks, 8 warps; 16-bit inputs (tensor cores): 32-token chunks, 8
    warps, 2 pipeline stages in dq/dk. The chunk cap follows (the gate chose these)."""
    from hla_sp.kernels._tiles import chunk_tile, tiling

    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        t = tiling(torch.float32)
        assert (t.block, t.num_warps, t.num_stages) == (32, 4, 3)
        assert chunk_tile(64, torch.float32) == 16 and chunk_tile(16, torch.float32) == 16
        torch.set_float32_matmul_precision("high")  # TF32
        t = tiling(torch.float32)
        assert (t.block, t.num_warps, t.num_stages) == (32, 8, 3)
        assert chunk_tile(64, torch.float32) == 32 and chunk_tile(16, torch.float32) == 16
    finally:
        torch.set_float32_matmul_precision(before)
    for dt in (torch.bfloat16, torch.float16):
        t = tiling(dt)
        assert (t.block, t.num_warps, t.narrow_stages) == (32, 8, 2)
        assert chunk_tile(128, dt) == 32


def test_fused_hla2_sequential_refuses_fp32_k128(kernels: ModuleType) -> None:
    """fp32 sequential at K = 128 would ask for more shared memory than any arch allows
    (246 KB, 295 KB with TF32): refused before launch with the reason; bf16 runs."""
    def qkv(dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(1, 3, 1, 128, device=DEVICE).to(dtype)

    x = qkv(torch.float32)
    before = kernels.LAUNCHES["fused_hla2_fwd_kernel"]
    with pytest.raises(ValueError, match=r"fp32 inputs need K <= 64, got K = 128.*shared"):
        hla2_fused(x, x, x, mode="sequential")
    assert kernels.LAUNCHES["fused_hla2_fwd_kernel"] == before
    o, _ = hla2_fused(*(qkv(torch.bfloat16) for _ in range(3)), mode="sequential")
    assert kernels.LAUNCHES["fused_hla2_fwd_kernel"] == before + 1
    assert o.shape == (1, 3, 1, 128) and bool(torch.isfinite(o.float()).all())

"""Hard resets and huge decays on the Triton path (issue 10 item 2, issue 12 item 4).

A log-decay of -inf at one token ("forget everything") or a huge negative one
(-1e4, -1e6, -1e30) in the middle of a chunk. The in-chunk weights used to be
exp(b_t - b_j) with b the chunk's prefix sum of log-decays: -inf - (-inf) is NaN, and
(-1e4 + a) - (-1e4 + b) loses |1e4| * 2^-24 of the exponent. The kernels now take every
exponent from stable segment sums (``hla_sp.kernels._decay``), so the error stays
within the bound that the mild decays alone would give.

Reference: the serial recurrences of ``hla_sp.ops.reference`` in fp64 (exp(-inf) = 0
multiplies a finite state, so the recurrence is exact there). Bound: elementwise
``depth * u * M`` (``hla_sp.testing.assert_within_rounding``), M the same recurrence
on absolute values and depth the fp32 roundings of the mild problem (the huge decay
contributes weights of exactly 0, so it adds no rounding). The kernels are called
through their launchers (``hla_sp.kernels``), below the operators' validation, and
run under the interpreter on CPU.
"""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch

from hla_sp.ops.reference import recurrent_hla2, recurrent_linear_attention
from hla_sp.testing import assert_within_rounding

B, H, K, V = 1, 2, 16, 16
T, CHUNK, SPOT = 40, 16, 21  # token 21 sits mid-chunk (chunk 1 holds tokens 16..31)
MILD = 0.3  # the other log-decays are in [-MILD, 0]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HUGE = [float("-inf"), -1e4, -1e6, -1e30]


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    import hla_sp.kernels as kernels

    return kernels


def inputs(huge: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp64 inputs; head 0 gets ``huge`` at SPOT, head 1 at SPOT + 5 and at token 3."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    g = -MILD * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    g[:, SPOT, 0] = huge
    g[:, SPOT + 5, 1] = huge
    g[:, 3, 1] = huge
    x = dict(q=rnd(B, T, H, K), k=rnd(B, T, H, K), v=rnd(B, T, H, V), g=g,
             h0=rnd(B, H, K, V), do=rnd(B, T, H, V))
    return {n: t.to(DEVICE) for n, t in x.items()}


def depth(stages: int = 1, tile: int = CHUNK) -> int:
    """fp32 roundings along one term's path of the mild problem (as
    tests/unit/kernels/test_kernels.py)."""
    return stages * (2 * (K + V + T) + 2 * tile * math.ceil(tile * MILD) + 16)


def _abs(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: (t if n == "g" else t.abs()) for n, t in x.items()}


@pytest.mark.parametrize(("chunk", "matmul"), [(16, "highest"), (32, "highest"),
                                               (64, "high")], ids=["c16", "c32", "c64-tf32"])
@pytest.mark.parametrize("huge", HUGE, ids=["-inf", "-1e4", "-1e6", "-1e30"])
def test_primitive_hard_reset_and_huge_decay(
    kernels: ModuleType, huge: float, chunk: int, matmul: str
) -> None:
    """o, h_T and dq, dk, dv, dh0 of the primitive, fp32 kernels against fp64, at every
    chunk size the kernels run (T = 40: the spot mid-chunk at 16, past a chunk's end at
    32, one chunk at 64, which only TF32 dots run; the interpreter computes them in fp32)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(matmul)
    try:
        _primitive_extremes(kernels, huge, chunk)
    finally:
        torch.set_float32_matmul_precision(before)


def _primitive_extremes(kernels: ModuleType, huge: float, chunk: int) -> None:
    x = inputs(huge)
    f32 = {n: t.float() for n, t in x.items()}
    o, h_last = kernels.chunk_forward(
        f32["q"], f32["k"], f32["v"], f32["g"], None, f32["h0"], chunk
    )
    dq, dk, dv, dg, dh0 = kernels.chunk_backward(
        f32["q"], f32["k"], f32["v"], f32["g"], None, f32["h0"], f32["do"], None, chunk
    )

    def ref(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        leaves = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v", "h0")}
        o, h = recurrent_linear_attention(
            leaves["q"], leaves["k"], leaves["v"], x["g"], scale=1.0, initial_state=leaves["h0"]
        )
        (o * x["do"]).sum().backward()
        return {"o": o.detach(), "h": h.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}

    want, mag = ref(x), ref(_abs(x))  # grads of the all-positive problem: sums of |terms|
    got = {"o": o, "h": h_last, "dq": dq, "dk": dk, "dv": dv, "dh0": dh0}
    for name, t in got.items():
        assert_within_rounding(name, t, want[name], mag[name],
                               {torch.float32: depth(tile=chunk)})
    assert dg is not None and bool(torch.isfinite(dg).all()), "dg: not finite"


@pytest.mark.parametrize("mode", ["chunked", "sequential"])
@pytest.mark.parametrize("huge", HUGE, ids=["-inf", "-1e4", "-1e6", "-1e30"])
def test_fused_hla2_hard_reset_and_huge_decay(kernels: ModuleType, huge: float, mode: str) -> None:
    """o, S_T and H_T of the fused hla2 (both modes), fp32 kernels against fp64."""
    x = inputs(huge, seed=1)
    f32 = {n: t.float() for n, t in x.items()}
    o, S_T, H_T = kernels.fused_hla2_forward(
        f32["q"], f32["k"], f32["v"], f32["g"], None, None, None, 0.0, CHUNK, mode
    )
    o_ref, (S_ref, H_ref, _) = recurrent_hla2(x["q"], x["k"], x["v"], x["g"], scale=1.0)
    a = _abs(x)
    o_mag, (S_mag, H_mag, _) = recurrent_hla2(a["q"], a["k"], a["v"], a["g"], scale=1.0)
    d = {torch.float32: depth(stages=2)}
    assert_within_rounding("o", o, o_ref, o_mag, d)
    assert_within_rounding("S_T", S_T, S_ref, S_mag, d)
    assert_within_rounding("H_T", H_T, H_ref, H_mag, d)

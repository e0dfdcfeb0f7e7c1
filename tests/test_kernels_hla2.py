"""The fused hla2 (``hla_sp.ops.hla2_fused`` on ``hla_sp.kernels.hla2_fused``) against
the composition.

The reference is ``hla_sp.hla2`` on the PyTorch path in fp64. Tolerance, in the
Frobenius norm of each output and gradient: at most twice the error of the PyTorch
path at the same precision, plus 2^-20 of the reference's norm (the two paths round in
different orders). The norm is used rather than the max because hla2's gradients pass
two stages, which makes single-element error ratios noisy; with ``normalize`` the
denominator can be near zero (the paper's definition), and both paths then lose
digits in the same places, which is why the comparison is relative to PyTorch's
own error and not to a fixed bound. Runs under the interpreter on CPU, as in
tests/test_kernels.py.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

import hla_sp
from hla_sp.ops import hla2_fused

H, K, V = 2, 16, 32
CHUNK = 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FUSED = {"chunked": "hla2_fwd_o_kernel", "sequential": "fused_hla2_fwd_kernel"}


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HLA_SP_BACKEND", "torch")  # for the references
    import hla_sp.kernels as kernels

    return kernels


def assert_close(name: str, got: torch.Tensor, same_prec: torch.Tensor, ref: torch.Tensor) -> None:
    got, same_prec, ref = got.double(), same_prec.double(), ref.double()
    err = (got - ref).norm().item()
    base = (same_prec - ref).norm().item()
    floor = 2.0**-20 * ref.norm().item()
    msg = f"{name}: error {err:.3e}, torch's {base:.3e}, floor {floor:.3e}"
    assert err <= 2 * base + floor, msg


def inputs(
    T: int, decay: str, seed: int, dims: tuple[int, int] = (K, V)
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    K, V = dims

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(DEVICE)

    a = -0.4 * torch.rand(*((1, T, H) if decay == "token" else (H,)), generator=gen)
    return dict(
        q=rnd(1, T, H, K), k=rnd(1, T, H, K), v=rnd(1, T, H, V), a=a.double().to(DEVICE),
        S0=_sym(rnd(1, H, K, K)), H0=rnd(1, H, K, V), eta0=rnd(1, H, K), do=rnd(1, T, H, V),
    )


def run(fn: object, x: dict, dtype: torch.dtype, **kw: object) -> dict[str, torch.Tensor]:
    """Outputs and gradients; the loss touches o and, when returned, both final states."""
def _sym(x: torch.Tensor) -> torch.Tensor:
    """A key moment is symmetric (S = sum k k^T); the operators refuse any other S0."""
    return (x + x.transpose(-1, -2)) / 2


    states = kw.pop("states", True)
    names = ["q", "k", "v", "a"]
    if states:
        names += ["S0", "H0"] + (["eta0"] if kw.get("normalize") else [])
    leaves = {n: x[n].clone().to(dtype).requires_grad_() for n in names}
    init = None
    if states:
        init = hla_sp.HLA2State(leaves["S0"], leaves["H0"], leaves.get("eta0"))
    o, st = fn(  # type: ignore[operator]
        leaves["q"], leaves["k"], leaves["v"], log_decay=leaves["a"], initial_state=init,
        output_final_state=states, chunk_size=CHUNK, **kw,
    )
    loss = (o.double() * x["do"]).sum()
    out = {"o": o.detach()}
    if states:
        loss = loss + st.S.double().sin().sum() + st.H.double().cos().sum()
        out.update(S=st.S.detach(), H=st.H.detach())
    loss.backward()
    out.update({f"d{n}": t.grad for n, t in leaves.items()})
    return out


@pytest.mark.parametrize(
    ("T", "decay", "opts", "dims"),
    [
        pytest.param(33, "token", {}, (K, V), id="T33-token-states"),
        pytest.param(17, "head", {"ridge": 0.3, "normalize": True}, (K, V),
                     id="T17-head-ridge-norm"),
        # K = 24 pads the on-chip K x K state to 32; V = 40 in three 16-wide blocks
        pytest.param(20, "token", {}, (24, 40), id="T20-K24-V40-blocks"),
    ],
)
@pytest.mark.parametrize("mode", ["chunked", "sequential"])
def test_fused_hla2_fp32(
    kernels: ModuleType, monkeypatch: pytest.MonkeyPatch, T: int, decay: str, opts: dict,
    dims: tuple[int, int], mode: str,
) -> None:
    monkeypatch.setattr(kernels.chunk, "BLOCK_CAP", 16 if dims != (K, V) else 64)
    x = inputs(T, decay, seed=T, dims=dims)
    ref = run(hla_sp.hla2, x, torch.float64, **opts)
    torch32 = run(hla_sp.hla2, x, torch.float32, **opts)
    before = kernels.LAUNCHES[FUSED[mode]]
    got = run(hla2_fused, x, torch.float32, mode=mode, **opts)
    assert kernels.LAUNCHES[FUSED[mode]] == before + 1
    assert set(got) == set(ref)
    for name in ref:
        assert_close(name, got[name], torch32[name], ref[name])


@pytest.mark.parametrize("mode", ["chunked", "sequential"])
def test_fused_hla2_varlen(kernels: ModuleType, mode: str) -> None:
    """Packed documents: starts cut both stages' carries (chunk-aligned start at 16)."""
    x = inputs(40, "token", seed=7)
    cu = torch.tensor([0, 5, 16, 40])
    ref = run(hla_sp.hla2, x, torch.float64, cu_seqlens=cu, states=False)
    torch32 = run(hla_sp.hla2, x, torch.float32, cu_seqlens=cu, states=False)
    before = kernels.LAUNCHES[FUSED[mode]]
    got = run(hla2_fused, x, torch.float32, cu_seqlens=cu, states=False, mode=mode)
    assert kernels.LAUNCHES[FUSED[mode]] == before + 1
    for name in ref:
        assert_close(name, got[name], torch32[name], ref[name])
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        hla2_fused(x["q"], x["k"], x["v"], cu_seqlens=cu, output_final_state=True)


def test_fused_hla2_keeps_k_tilde_on_chip(kernels: ModuleType) -> None:
    """The forward never runs the primitive's output kernel, which is what would write
    k~ to memory; it launches the fused kernels instead."""
    x = inputs(20, "token", seed=11)
    for mode, fused in FUSED.items():
        before = dict(kernels.LAUNCHES)
        with torch.no_grad():
            hla2_fused(x["q"].float(), x["k"].float(), x["v"].float(), mode=mode)
        ran = {n for n, c in kernels.LAUNCHES.items() if c > before.get(n, 0)}
        assert fused in ran and "chunk_fwd_o_kernel" not in ran, (mode, ran)
    with pytest.raises(ValueError, match="mode"):
        hla2_fused(x["q"].float(), x["k"].float(), x["v"].float(), mode="nope")


@pytest.mark.parametrize("mode", ["chunked", "sequential"])
def test_fused_hla2_bf16_forward(kernels: ModuleType, mode: str) -> None:
    """bf16: the relative error in norm stays within 8 unit roundoffs (2^-8 each): the
    output and the stage-1 key k~ are rounded once, the dot operands of both stages
    once more, and k~'s error passes into the output through a second product."""
    x = inputs(33, "token", seed=9)
    xr = {n: t.to(torch.bfloat16).double() for n, t in x.items()}
    ref = run(hla_sp.hla2, xr, torch.float64)
    got = run(hla2_fused, x, torch.bfloat16, mode=mode)
    assert got["o"].dtype == torch.bfloat16
    for name in ("o", "S", "H"):
        err = ((got[name].double() - ref[name]).norm() / ref[name].norm()).item()
        assert err <= 8 * 2.0**-8, f"{name}: relative error {err:.2e}"


def test_fused_hla2_needs_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    if DEVICE != "cpu":
        pytest.skip("CPU tensors without the interpreter")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 4, H, K)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        hla2_fused(q, q, q)

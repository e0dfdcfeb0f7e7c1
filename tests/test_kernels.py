"""The Triton kernels of the primitive against the PyTorch chunk path.

On a machine without CUDA they run under Triton's CPU interpreter: the fixture sets
``TRITON_INTERPRET=1`` through monkeypatch, and the kernels read it at launch (they
are jitted lazily, see ``hla_sp.kernels._jit``). With CUDA they run on the GPU.
The interpreter is slow: shapes are tiny, chunks are 16 long, cases are few.

Tolerance (flash-attention's rule): the Triton result may be off from an fp64
reference by at most twice the error the PyTorch path itself makes at the same
precision, plus a floor of 2^-20 of the reference's magnitude for elements where the
PyTorch error happens to be near zero (the kernels sum in a different order; fp32
has 24 bits). Every test also checks the launch counter, so a silent fallback to
the PyTorch path cannot pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

import hla_sp
from hla_sp.ops.chunk import chunk_linear_attention

K, V, H = 16, 32, 2
CHUNK = 16


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def interp(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    """The Triton backend forced (on CPU: the interpreter); the kernels module."""
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HLA_SP_BACKEND", "triton")
    import hla_sp.kernels as kernels

    yield SimpleNamespace(fn=kernels.chunk_linear_attention_triton, launches=launches)


def launches() -> int:
    """Kernel launches so far (0 if the kernels were never imported)."""
    import sys

    mod = sys.modules.get("hla_sp.kernels._jit")
    return 0 if mod is None else sum(mod.LAUNCHES.values())


def assert_close(name: str, got: torch.Tensor, same_prec: torch.Tensor, ref: torch.Tensor) -> None:
    """|got - ref| <= 2 |same_prec - ref| + 2^-20 max|ref|, elementwise in the max norm."""
    got, same_prec, ref = got.double(), same_prec.double(), ref.double()
    err = (got - ref).abs().max().item()
    base = (same_prec - ref).abs().max().item()
    floor = 2.0**-20 * max(ref.abs().max().item(), 1e-30)
    msg = f"{name}: error {err:.3e}, torch's {base:.3e}, floor {floor:.3e}"
    assert err <= 2 * base + floor, msg


def make_inputs(
    B: int, T: int, decay: str | None, *, seed: int = 0, dims: tuple[int, int] = (K, V)
) -> dict[str, torch.Tensor | None]:
    """fp64 inputs: q already scaled, log-decay per head ([H] broadcast) or per token."""
    gen = torch.Generator().manual_seed(seed)
    K, V = dims

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    g = None
    if decay == "head":
        g = (-0.5 * torch.rand(H, generator=gen, dtype=torch.float64)).expand(B, T, H)
    elif decay == "token":
        g = -0.5 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    x = dict(
        q=rnd(B, T, H, K) * K**-0.5, k=rnd(B, T, H, K), v=rnd(B, T, H, V), g=g,
        h0=rnd(B, H, K, V), do=rnd(B, T, H, V), dht=rnd(B, H, K, V),
    )
    return {n: None if t is None else t.to(DEVICE) for n, t in x.items()}


def run(
    fn: object, x: dict, dtype: torch.dtype, *, use_h0: bool, resets: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Forward and backward of a chunk implementation; loss = <o, do> + <h_T, dh_T>."""
    names = ["q", "k", "v"] + (["g"] if x["g"] is not None else []) + (["h0"] if use_h0 else [])
    leaves = {n: x[n].detach().clone().to(dtype).requires_grad_() for n in names}
    g = leaves.get("g")
    o, h = fn(  # type: ignore[operator]
        leaves["q"], leaves["k"], leaves["v"], g, resets=resets, h0=leaves.get("h0"),
        chunk_size=CHUNK,
    )
    loss = (o.double() * x["do"]).sum() + (h.double() * x["dht"]).sum()
    loss.backward()
    out = {"o": o.detach(), "h_T": h.detach()}
    out.update({f"d{n}": t.grad for n, t in leaves.items()})
    return out


CASES = [
    # id, B, T, decay, h0
    pytest.param(2, 1, "head", True, id="T1-B2-head-h0"),
    pytest.param(1, 63, "token", True, id="T63-token-h0"),
    pytest.param(1, 65, None, False, id="T65-nodecay"),
    pytest.param(1, 65, "head", True, id="T65-head-h0"),
]


@pytest.mark.parametrize(("B", "T", "decay", "use_h0"), CASES)
def test_chunk_fwd_bwd_fp32(
    interp: SimpleNamespace, B: int, T: int, decay: str | None, use_h0: bool
) -> None:
    x = make_inputs(B, T, decay)
    ref = run(chunk_linear_attention, x, torch.float64, use_h0=use_h0)
    torch32 = run(chunk_linear_attention, x, torch.float32, use_h0=use_h0)
    before = launches()
    tri = run(interp.fn, x, torch.float32, use_h0=use_h0)
    assert launches() - before >= 7, "the Triton kernels did not run"
    assert tri["o"].dtype == torch.float32 and tri["h_T"].dtype == torch.float32
    assert set(tri) == set(ref)
    for name in ref:
        assert_close(name, tri[name], torch32[name], ref[name])


def test_chunk_resets(interp: SimpleNamespace) -> None:
    """Document starts cut the carry, also at a chunk's first position (16, 32)."""
    B, T = 2, 50
    x = make_inputs(B, T, "token", seed=1)
    resets = torch.zeros(B, T, dtype=torch.bool, device=DEVICE)
    resets[0, [5, 16, 20]] = True
    resets[1, [32, 33, 49]] = True
    ref = run(chunk_linear_attention, x, torch.float64, use_h0=True, resets=resets)
    torch32 = run(chunk_linear_attention, x, torch.float32, use_h0=True, resets=resets)
    before = launches()
    tri = run(interp.fn, x, torch.float32, use_h0=True, resets=resets)
    assert launches() > before
    for name in ref:
        assert_close(name, tri[name], torch32[name], ref[name])


def test_several_blocks(interp: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """16-wide tiles with K = 24, V = 40: several K and V blocks, the last ones partial
    (the GPU shape K = V = 128 runs 2 x 2 blocks of 64), with resets and h0."""
    import hla_sp.kernels.chunk as kchunk

    monkeypatch.setattr(kchunk, "BLOCK_CAP", 16)
    B, T = 1, 40
    x = make_inputs(B, T, "token", seed=8, dims=(24, 40))
    resets = torch.zeros(B, T, dtype=torch.bool, device=DEVICE)
    resets[0, [16, 23]] = True
    ref = run(chunk_linear_attention, x, torch.float64, use_h0=True, resets=resets)
    torch32 = run(chunk_linear_attention, x, torch.float32, use_h0=True, resets=resets)
    before = dict(launch_counts())
    tri = run(interp.fn, x, torch.float32, use_h0=True, resets=resets)
    assert launch_counts()["chunk_bwd_dqk_kernel"] > before.get("chunk_bwd_dqk_kernel", 0)
    for name in ref:
        assert_close(name, tri[name], torch32[name], ref[name])


def launch_counts() -> dict[str, int]:
    from hla_sp.kernels import LAUNCHES

    return dict(LAUNCHES)


@pytest.mark.parametrize(
    ("dtype", "rtol"),
    [
        pytest.param(torch.bfloat16, 2.0**-6, id="bf16"),
        pytest.param(torch.float16, 2.0**-9, id="fp16"),
    ],
)
def test_chunk_half(interp: SimpleNamespace, dtype: torch.dtype, rtol: float) -> None:
    """16-bit inputs, forward and backward: fp32 accumulation and states, dot operands in the
    input dtype (as fla does). Both see the same rounded inputs; the reference is fp64.
    The bound: the relative error in norm is at most 4 unit roundoffs of the dtype
    (2^-8 bf16, 2^-11 fp16): the output is rounded once, and the operands of the second
    dots (masked scores, q * carry weight, states) once more each."""
    x = make_inputs(1, 65, "token", seed=2)
    xr = {n: (None if t is None else t.to(dtype).double()) for n, t in x.items()}
    ref = run(chunk_linear_attention, xr, torch.float64, use_h0=True)
    before = launches()
    tri = run(interp.fn, x, dtype, use_h0=True)
    assert launches() > before
    # the compute dtype, as the torch path: the caller rounds o once, at the end
    assert tri["o"].dtype == torch.float32 and tri["h_T"].dtype == torch.float32
    for name in ("o", "h_T", "dq", "dk", "dv", "dg", "dh0"):
        err = ((tri[name].double() - ref[name]).norm() / ref[name].norm()).item()
        print(f"{dtype} {name}: relative error {err:.2e}")
        assert err <= rtol, f"{name}: relative error {err:.2e} > {rtol:.2e}"


def test_public_varlen(interp: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """linear_attention(cu_seqlens=...) with per-document initial and final states,
    per-head decay as an [H] tensor, Triton against the torch backend."""
    T = 40
    cu = torch.tensor([0, 7, 23, 40])
    x = make_inputs(1, T, None, seed=3)
    gen = torch.Generator().manual_seed(4)
    a = (-0.5 * torch.rand(H, dtype=torch.float64, generator=gen)).to(DEVICE)
    h0 = torch.randn(3, H, K, V, dtype=torch.float64, generator=gen).to(DEVICE)
    dht = torch.randn(3, H, K, V, dtype=torch.float64, generator=gen).to(DEVICE)

    def go(dtype: torch.dtype) -> list[torch.Tensor]:
        leaves = [
            t.detach().clone().to(dtype).requires_grad_() for t in (x["q"], x["k"], x["v"], a, h0)
        ]
        o, hT = hla_sp.linear_attention(
            *leaves[:3], log_decay=leaves[3], initial_state=leaves[4], output_final_state=True,
            cu_seqlens=cu, chunk_size=CHUNK, scale=1.0,
        )
        ((o.double() * x["do"]).sum() + (hT.double() * dht).sum()).backward()
        return [o.detach(), hT.detach()] + [t.grad for t in leaves]

    monkeypatch.setenv("HLA_SP_BACKEND", "torch")
    ref, torch32 = go(torch.float64), go(torch.float32)
    monkeypatch.setenv("HLA_SP_BACKEND", "triton")
    before = launches()
    tri = go(torch.float32)
    assert launches() > before
    names = ["o", "h_T", "dq", "dk", "dv", "dlog_decay", "dh0"]
    for name, t, b, r in zip(names, tri, torch32, ref):
        assert_close(name, t, b, r)


def test_public_hla2(interp: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """hla2 (two stages of the primitive) on the Triton kernels, outputs and gradients."""
    x = make_inputs(1, 33, "token", seed=5)

    def go(dtype: torch.dtype) -> list[torch.Tensor]:
        leaves = [x[n].detach().clone().to(dtype).requires_grad_() for n in ("q", "k", "v", "g")]
        o, st = hla_sp.hla2(
            *leaves[:3], log_decay=leaves[3], output_final_state=True, chunk_size=CHUNK
        )
        ((o.double() * x["do"]).sum() + st.H.double().sum() + st.S.double().sum()).backward()
        return [o.detach(), st.S, st.H] + [t.grad for t in leaves]

    monkeypatch.setenv("HLA_SP_BACKEND", "torch")
    ref, torch32 = go(torch.float64), go(torch.float32)
    monkeypatch.setenv("HLA_SP_BACKEND", "triton")
    before = launches()
    tri = go(torch.float32)
    assert launches() > before
    for name, t, b, r in zip(["o", "S", "H", "dq", "dk", "dv", "dg"], tri, torch32, ref):
        assert_close(name, t, b, r)


def test_small_chunk_and_no_final_grad(interp: SimpleNamespace) -> None:
    """chunk_size < 16 runs with 16-long tiles; a loss on o alone (dh_T = None)."""
    x = make_inputs(1, 20, "token", seed=6)
    leaves = [x[n].float().requires_grad_() for n in ("q", "k", "v", "g")]
    o, _ = interp.fn(*leaves, chunk_size=4)
    (o * x["do"].float()).sum().backward()
    ref_leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g")]
    o_ref, _ = chunk_linear_attention(*ref_leaves, chunk_size=4)
    (o_ref * x["do"]).sum().backward()
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-5, atol=1e-5)


def test_final_state_loss_only(interp: SimpleNamespace) -> None:
    """A loss on h_T alone (the output's gradient is None in the backward)."""
    x = make_inputs(1, 24, "token", seed=9)
    names = ("q", "k", "v", "g", "h0")
    tri = [x[n].float().requires_grad_() for n in names]
    ref = [x[n].clone().requires_grad_() for n in names]
    before = launches()
    (interp.fn(*tri[:4], h0=tri[4], chunk_size=CHUNK)[1] * x["dht"].float()).sum().backward()
    assert launches() > before
    (chunk_linear_attention(*ref[:4], h0=ref[4], chunk_size=CHUNK)[1] * x["dht"]).sum().backward()
    for n, a, b in zip(names, tri, ref):
        want = torch.zeros_like(b) if b.grad is None else b.grad  # q does not reach h_T
        torch.testing.assert_close(a.grad.double(), want, rtol=1e-5, atol=1e-5, msg=n)


def test_triton_unavailable_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forcing Triton on CPU without the interpreter, or for fp64, raises; never falls back."""
    from hla_sp.kernels import chunk_linear_attention_triton

    monkeypatch.setenv("HLA_SP_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 4, H, K)
    before = launches()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        hla_sp.linear_attention(q, q, torch.randn(1, 4, H, V))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="float64"):
        hla_sp.linear_attention(q.double(), q.double(), torch.randn(1, 4, H, V).double())
    with pytest.raises(TypeError, match="float64"):
        chunk_linear_attention_triton(q.double(), q.double(), q.double(), None)
    assert launches() == before
    # auto on CPU is the torch path, with no launch
    monkeypatch.setenv("HLA_SP_BACKEND", "auto")
    hla_sp.linear_attention(q, q, torch.randn(1, 4, H, V))
    assert launches() == before

"""The Triton kernels of the primitive against the PyTorch chunk path.

On a machine without CUDA they run under Triton's CPU interpreter: the fixture sets
``TRITON_INTERPRET=1`` through monkeypatch, and the kernels read it at launch (they
are jitted lazily, see ``hla_sp.kernels._jit``). With CUDA they run on the GPU.
The interpreter is slow: shapes are tiny, chunks are 16 long, cases are few.

Tolerance: the condition of the computation, not one machine's result. Each output
and gradient may be off from the fp64 reference by at most ``depth * u * M``
elementwise (``hla_sp.testing.assert_within_rounding``), M the same computation in
fp64 on absolute values (|q|, |k|, |v|, |h0|, |do|, |dh_T|; decay weights are
positive) and depth the roundings along one term's path (:func:`depth`). It holds
for any summation order, so for any CPU, SIMD width and thread count; the tests run
at 1 and 2 threads. Every test also checks the launch counter, so a silent fallback
to the PyTorch path cannot pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

import hla_sp
from hla_sp.ops.primitive import make_chunk_impl
from hla_sp.testing import assert_within_rounding, decay_grad_magnitude

# the reference: the torch backend of the same operator, whatever HLA_SP_BACKEND says
chunk_linear_attention = make_chunk_impl("torch")
K, V, H = 16, 32, 2
CHUNK = 16


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def interp(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    """The Triton backend forced (on CPU: the interpreter); the kernels module."""
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HLA_SP_BACKEND", "triton")
    from hla_sp.ops.primitive import chunk_linear_attention_triton

    yield SimpleNamespace(fn=chunk_linear_attention_triton, launches=launches)


def launches() -> int:
    """Kernel launches so far (0 if the kernels were never imported)."""
    import sys

    mod = sys.modules.get("hla_sp.kernels._jit")
    return 0 if mod is None else sum(mod.LAUNCHES.values())


def depth(T: int, K: int, V: int, g: torch.Tensor | None, chunk: int = CHUNK) -> int:
    """Most fp32 roundings along one term's path, forward or backward (first order):
    the casts of the inputs, dots over K and V, sums over at most T tokens (in-chunk
    plus chunk carries), and the decay weights, whose exponents are prefix sums of up
    to ``chunk`` log-decays (an exponent's absolute error, chunk * u * sum|g| per
    chunk, is the weight's relative error)."""
    tile = max(chunk, 16)
    gmax = 0.0 if g is None else float(g.detach().abs().max())
    return 2 * (K + V + T) + 2 * tile * math.ceil(tile * gmax) + 16


def abs_inputs(x: dict) -> dict:
    """The inputs of the magnitude computation: every tensor's absolute value, except
    the log-decay (its weights exp(A_t - A_j) are positive already)."""
    return {n: t if (t is None or n in ("g", "a")) else t.abs() for n, t in x.items()}


def check_all(
    got: dict, ref: dict, mag: dict, d: int, dtype: torch.dtype = torch.float32,
    low: int = 0,
) -> None:
    """Every output and gradient within its rounding bound; ``low`` roundings in a
    16-bit ``dtype`` on top of ``d`` in fp32."""
    assert set(got) == set(ref) == set(mag)
    roundings = {torch.float32: d} | ({dtype: low} if low else {})
    for name in ref:
        assert_within_rounding(name, got[name], ref[name], mag[name], roundings)


def magnitudes(x: dict, *, use_h0: bool, resets: torch.Tensor | None = None) -> dict:
    """:func:`run` in fp64 on absolute values, with the decay gradient's magnitude."""
    ax = abs_inputs(x)
    mag = run(chunk_linear_attention, ax, torch.float64, use_h0=use_h0, resets=resets)
    if "dg" in mag:
        loss = (mag["o"] * ax["do"]).sum((1, 3)) + (mag["h_T"] * ax["dht"]).sum((2, 3))
        mag["dg"] = decay_grad_magnitude(loss, tuple(x["g"].shape), x["g"].shape[1])
    return mag


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
    fn: object, x: dict, dtype: torch.dtype, *, use_h0: bool, resets: torch.Tensor | None = None,
    chunk: int = CHUNK,
) -> dict[str, torch.Tensor]:
    """Forward and backward of a chunk implementation; loss = <o, do> + <h_T, dh_T>."""
    names = ["q", "k", "v"] + (["g"] if x["g"] is not None else []) + (["h0"] if use_h0 else [])
    leaves = {n: x[n].detach().clone().to(dtype).requires_grad_() for n in names}
    g = leaves.get("g")
    o, h = fn(  # type: ignore[operator]
        leaves["q"], leaves["k"], leaves["v"], g, resets=resets, h0=leaves.get("h0"),
        chunk_size=chunk,
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
    interp: SimpleNamespace, num_threads: int, B: int, T: int, decay: str | None, use_h0: bool
) -> None:
    x = make_inputs(B, T, decay)
    ref = run(chunk_linear_attention, x, torch.float64, use_h0=use_h0)
    torch32 = run(chunk_linear_attention, x, torch.float32, use_h0=use_h0)
    before = launches()
    tri = run(interp.fn, x, torch.float32, use_h0=use_h0)
    # forward: states, output, the gated poison; backward: states again, their
    # gradients, dv, dq/dk/dg, the gated poison
    assert launches() - before == 8, "the Triton kernels did not run"
    assert tri["o"].dtype == torch.float32 and tri["h_T"].dtype == torch.float32
    mag, d = magnitudes(x, use_h0=use_h0), depth(T, K, V, x["g"])
    check_all(tri, ref, mag, d)
    check_all(torch32, ref, mag, d)  # the PyTorch path meets the same bound


@pytest.mark.parametrize(("chunk", "matmul"), [(16, "highest"), (32, "highest"),
                                               (64, "high")], ids=["c16", "c32", "c64-tf32"])
def test_chunk_resets(interp: SimpleNamespace, num_threads: int, chunk: int, matmul: str) -> None:
    """Document starts cut the carry, also at a chunk's first position, at every chunk
    size the kernels run (the state passes walk 3 chunks; 64-token chunks are those of
    TF32 dots, which the interpreter computes in fp32)."""
    B, T = 2, 2 * chunk + 5
    x = make_inputs(B, T, "token", seed=1)
    resets = torch.zeros(B, T, dtype=torch.bool, device=DEVICE)
    resets[0, [5, chunk, chunk + 4]] = True
    resets[1, [2 * chunk, 2 * chunk + 1, T - 1]] = True
    ref = run(chunk_linear_attention, x, torch.float64, use_h0=True, resets=resets, chunk=chunk)
    torch32 = run(chunk_linear_attention, x, torch.float32, use_h0=True, resets=resets,
                  chunk=chunk)
    before, prec = launches(), torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(matmul)
    try:
        tri = run(interp.fn, x, torch.float32, use_h0=True, resets=resets, chunk=chunk)
    finally:
        torch.set_float32_matmul_precision(prec)
    assert launches() - before == 8
    mag, d = magnitudes(x, use_h0=True, resets=resets), depth(T, K, V, x["g"], chunk)
    check_all(tri, ref, mag, d)
    check_all(torch32, ref, mag, d)


def test_several_blocks(
    interp: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, num_threads: int
) -> None:
    """16-wide tiles with K = 24, V = 40: several K and V blocks, the last ones partial
    (the GPU shape K = V = 128 runs 2 x 2 blocks of 64), with resets and h0."""
    import hla_sp.kernels._tiles as tiles

    monkeypatch.setattr(tiles, "BLOCK_CAP", 16)
    B, T = 1, 40
    x = make_inputs(B, T, "token", seed=8, dims=(24, 40))
    resets = torch.zeros(B, T, dtype=torch.bool, device=DEVICE)
    resets[0, [16, 23]] = True
    ref = run(chunk_linear_attention, x, torch.float64, use_h0=True, resets=resets)
    torch32 = run(chunk_linear_attention, x, torch.float32, use_h0=True, resets=resets)
    before = dict(launch_counts())
    tri = run(interp.fn, x, torch.float32, use_h0=True, resets=resets)
    assert launch_counts()["chunk_bwd_dqk_kernel"] > before.get("chunk_bwd_dqk_kernel", 0)
    mag, d = magnitudes(x, use_h0=True, resets=resets), depth(T, 24, 40, x["g"])
    check_all(tri, ref, mag, d)
    check_all(torch32, ref, mag, d)


def launch_counts() -> dict[str, int]:
    from hla_sp.kernels import LAUNCHES

    return dict(LAUNCHES)


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_chunk_half(
    interp: SimpleNamespace, dtype: torch.dtype, num_threads: int, chunk: int
) -> None:
    """16-bit inputs, forward and backward: fp32 accumulation and states, dot operands in the
    input dtype (as fla does). Both see the same rounded inputs; the reference is fp64.
    The bound, elementwise: 8 roundings in the 16-bit dtype (the output's, and those of
    the operands of the second dots: masked scores, q * carry weight, states, and their
    backward counterparts) plus the fp32 depth, times the magnitude. The per-chunk
    states are stored in the 16-bit dtype, as the dots read them."""
    x = make_inputs(1, 65, "token", seed=2)
    xr = {n: (None if t is None else t.to(dtype).double()) for n, t in x.items()}
    ref = run(chunk_linear_attention, xr, torch.float64, use_h0=True, chunk=chunk)
    before = launches()
    tri = run(interp.fn, x, dtype, use_h0=True, chunk=chunk)
    assert launches() - before == 8
    # o in the inputs' dtype, rounded once by the kernel's store (no cast pass after)
    assert tri["o"].dtype == dtype and tri["h_T"].dtype == torch.float32
    mag = magnitudes(xr, use_h0=True)
    check_all(tri, ref, mag, depth(65, K, V, xr["g"], chunk), dtype, low=8)


def test_public_varlen(
    interp: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, num_threads: int
) -> None:
    """linear_attention(cu_seqlens=...) with per-document initial and final states,
    per-head decay as an [H] tensor, Triton against the torch backend."""
    T = 40
    cu = torch.tensor([0, 7, 23, 40])
    x = make_inputs(1, T, None, seed=3)
    gen = torch.Generator().manual_seed(4)
    a = (-0.5 * torch.rand(H, dtype=torch.float64, generator=gen)).to(DEVICE)
    h0 = torch.randn(3, H, K, V, dtype=torch.float64, generator=gen).to(DEVICE)
    dht = torch.randn(3, H, K, V, dtype=torch.float64, generator=gen).to(DEVICE)

    names = ["o", "h_T", "dq", "dk", "dv", "dlog_decay", "dh0"]

    def go(dtype: torch.dtype, absolute: bool = False) -> dict[str, torch.Tensor]:
        f = torch.abs if absolute else (lambda t: t)
        leaves = [
            t.detach().clone().to(dtype).requires_grad_()
            for t in (f(x["q"]), f(x["k"]), f(x["v"]), a, f(h0))
        ]
        o, hT = hla_sp.linear_attention(
            *leaves[:3], log_decay=leaves[3], initial_state=leaves[4], output_final_state=True,
            cu_seqlens=cu, chunk_size=CHUNK, scale=1.0,
        )
        ((o.double() * f(x["do"])).sum() + (hT.double() * f(dht)).sum()).backward()
        return dict(zip(names, [o.detach(), hT.detach()] + [t.grad for t in leaves]))

    monkeypatch.setenv("HLA_SP_BACKEND", "torch")
    ref, torch32, mag = go(torch.float64), go(torch.float32), go(torch.float64, absolute=True)
    loss = (mag["o"] * x["do"].abs()).sum((1, 3)) + (mag["h_T"] * dht.abs()).sum((0, 2, 3))
    mag["dlog_decay"] = decay_grad_magnitude(loss, (H,), T)
    monkeypatch.setenv("HLA_SP_BACKEND", "triton")
    before = launches()
    tri = go(torch.float32)
    assert launches() > before
    d = depth(T, K, V, a)
    check_all(tri, ref, mag, d)
    check_all(torch32, ref, mag, d)


def test_public_hla2(
    interp: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, num_threads: int
) -> None:
    """hla2 (two stages of the primitive) on the Triton kernels, outputs and gradients."""
    T = 33
    x = make_inputs(1, T, "token", seed=5)
    names = ["o", "S", "H", "dq", "dk", "dv", "dg"]

    def go(dtype: torch.dtype, absolute: bool = False) -> dict[str, torch.Tensor]:
        ax = abs_inputs(x) if absolute else x
        leaves = [ax[n].detach().clone().to(dtype).requires_grad_() for n in ("q", "k", "v", "g")]
        o, st = hla_sp.hla2(
            *leaves[:3], log_decay=leaves[3], output_final_state=True, chunk_size=CHUNK
        )
        ((o.double() * ax["do"]).sum() + st.H.double().sum() + st.S.double().sum()).backward()
        return dict(zip(names, [o.detach(), st.S.detach(), st.H.detach()]
                        + [t.grad for t in leaves]))  # fmt: skip

    monkeypatch.setenv("HLA_SP_BACKEND", "torch")
    ref, torch32, mag = go(torch.float64), go(torch.float32), go(torch.float64, absolute=True)
    # the loss on absolute values per (row, head): o's terms and the states' (weight 1)
    loss = (mag["o"] * x["do"].abs()).sum((1, 3)) + mag["S"].sum((2, 3)) + mag["H"].sum((2, 3))
    mag["dg"] = decay_grad_magnitude(loss, tuple(x["g"].shape), T, stages=2)
    monkeypatch.setenv("HLA_SP_BACKEND", "triton")
    before = launches()
    tri = go(torch.float32)
    assert launches() > before
    d = 2 * depth(T, K, V, x["g"])  # two stages, the second's keys from the first
    check_all(tri, ref, mag, d)
    check_all(torch32, ref, mag, d)


def test_small_chunk_and_no_final_grad(interp: SimpleNamespace, num_threads: int) -> None:
    """chunk_size < 16 runs with 16-long tiles; a loss on o alone (dh_T = None)."""
    T = 20
    x = make_inputs(1, T, "token", seed=6)
    names = ("q", "k", "v", "g")

    def go(fn: object, xs: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        leaves = [xs[n].detach().clone().to(dtype).requires_grad_() for n in names]
        o, _ = fn(*leaves, chunk_size=4)  # type: ignore[operator]
        (o.double() * xs["do"]).sum().backward()
        return {"o": o.detach()} | {f"d{n}": t.grad for n, t in zip(names, leaves)}

    tri = go(interp.fn, x, torch.float32)
    ref = go(chunk_linear_attention, x, torch.float64)
    ax = abs_inputs(x)
    mag = go(chunk_linear_attention, ax, torch.float64)
    mag["dg"] = decay_grad_magnitude((mag["o"] * ax["do"]).sum((1, 3)), (1, T, H), T)
    check_all(tri, ref, mag, depth(T, K, V, x["g"], chunk=4))


def test_final_state_loss_only(interp: SimpleNamespace, num_threads: int) -> None:
    """A loss on h_T alone (the output's gradient is None in the backward)."""
    T = 24
    x = make_inputs(1, T, "token", seed=9)
    names = ("q", "k", "v", "g", "h0")

    def go(fn: object, xs: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        leaves = [xs[n].detach().clone().to(dtype).requires_grad_() for n in names]
        h = fn(*leaves[:4], h0=leaves[4], chunk_size=CHUNK)[1]  # type: ignore[operator]
        (h.double() * xs["dht"]).sum().backward()
        # q does not reach h_T: its gradient is None, or exact zeros
        return {f"d{n}": torch.zeros_like(t) if t.grad is None else t.grad
                for n, t in zip(names, leaves)}  # fmt: skip

    before = launches()
    tri = go(interp.fn, x, torch.float32)
    assert launches() > before
    ref = go(chunk_linear_attention, x, torch.float64)
    ax = abs_inputs(x)
    mag = go(chunk_linear_attention, ax, torch.float64)
    h_abs = chunk_linear_attention(*(ax[n] for n in names[:4]), h0=ax["h0"], chunk_size=CHUNK)[1]
    mag["dg"] = decay_grad_magnitude((h_abs * ax["dht"]).sum((2, 3)), (1, T, H), T)
    check_all(tri, ref, mag, depth(T, K, V, x["g"]))


def test_triton_unavailable_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forcing Triton on CPU without the interpreter, or for fp64, raises; never falls back."""
    from hla_sp.ops.primitive import chunk_linear_attention_triton

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

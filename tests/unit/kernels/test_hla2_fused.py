"""The fused hla2 (``hla_sp.ops.hla2_fused`` on ``hla_sp.kernels.hla2_fused``) against
the composition.

The reference is ``hla_sp.hla2`` on the PyTorch path in fp64. Tolerance: the
condition of the computation, as in tests/unit/kernels/test_kernels.py: each output and gradient
within ``d * u * M`` elementwise (``hla_sp.testing.assert_within_rounding``), M the
same computation in fp64 on absolute values (the loss's sin/cos of the final states
weighted by 1, a bound on their derivatives), d the roundings of two stages. With
``normalize``, o = N / D: the normalised case takes q, k, S0, eta0 >= 0 (as
tests/unit/ops/test_ops.py does), so D sums positive terms, and the magnitude of o is
(|N| + |o| D) / D, of a gradient |dN| / D + |o| |dD| / D. bf16 adds 8 roundings in
bf16 (the output and the stage-1 key k~ once each, the dot operands of both stages,
k~'s error through a second product). Runs under the interpreter on CPU, as in
tests/unit/kernels/test_kernels.py, at 1 and 2 threads.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from test_kernels import depth

import hla_sp
from hla_sp.ops import hla2_fused
from hla_sp.ops.table import DEFAULT_EPS
from hla_sp.testing import assert_within_rounding, decay_grad_magnitude

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


def magnitudes(x: dict, T: int, **kw: object) -> dict[str, torch.Tensor]:
    """:func:`run` in fp64 on absolute values (the decay weights are positive already),
    the loss's state terms weighted by 1; the decay gradient's from its loss terms."""
    ax = {n: t if n == "a" else t.abs() for n, t in x.items()}
    states = kw.get("states", True)
    mag = run(hla_sp.hla2, ax, torch.float64, magnitude=True, **kw)
    loss = (mag["o"] * ax["do"]).sum((1, 3))
    if states:
        loss = loss + mag["S"].sum((2, 3)) + mag["H"].sum((2, 3))
    mag["da"] = decay_grad_magnitude(loss, tuple(x["a"].shape), T, stages=2)
    return mag


def magnitudes_normalized(x: dict, T: int, ridge: float) -> dict[str, torch.Tensor]:
    """As :func:`magnitudes` for o = N / (D + eps), with q, k, S0, eta0 >= 0: N and D
    are one unnormalised run on [|v|, 1] from [|H0|, eta0]; o's magnitude is
    (|N| + |o| D) / D and a gradient's |dN| / D + |o| |dD| / D (one more stage)."""
    ax = {n: t if n == "a" else t.abs() for n, t in x.items()}
    leaves = {n: ax[n].clone().requires_grad_() for n in ("q", "k", "v", "S0", "H0", "eta0")}
    v1 = torch.cat([leaves["v"], torch.ones_like(leaves["v"][..., :1])], -1)
    H01 = torch.cat([leaves["H0"], leaves["eta0"][..., None]], -1)
    o1, st = hla_sp.hla2(leaves["q"], leaves["k"], v1, log_decay=ax["a"], ridge=ridge,
                         initial_state=hla_sp.HLA2State(leaves["S0"], H01),
                         output_final_state=True, chunk_size=CHUNK)
    Vd = x["v"].shape[-1]
    N, D = o1[..., :Vd], o1[..., Vd:] + DEFAULT_EPS
    o = N / D.detach()
    o_mag = (N + o * D) / D  # (|N| + |o| D) / D, |o| = N / D here
    Hf = st.H[..., :Vd]
    loss = ((o * ax["do"]).sum() + (o.detach() * ax["do"] * D / D.detach()).sum()
            + st.S.sum() + Hf.sum())
    loss.backward()
    terms = 2 * (o_mag * ax["do"]).sum((1, 3)) + st.S.sum((2, 3)) + Hf.sum((2, 3))
    mag = {"o": o_mag.detach(), "S": st.S.detach(), "H": Hf.detach()}
    mag.update({f"d{n}": t.grad for n, t in leaves.items()})
    mag["da"] = decay_grad_magnitude(terms.detach(), tuple(x["a"].shape), T, stages=3)
    return mag


def check_within_rounding(got: dict, ref: dict, mag: dict, d: int,
                          low: dict | None = None) -> None:
    roundings = {torch.float32: d} | (low or {})
    for name in ref:
        assert_within_rounding(name, got[name], ref[name], mag[name], roundings)


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


def _sym(x: torch.Tensor) -> torch.Tensor:
    """A key moment is symmetric (S = sum k k^T); the operators refuse any other S0."""
    return (x + x.transpose(-1, -2)) / 2


def run(fn: object, x: dict, dtype: torch.dtype, **kw: object) -> dict[str, torch.Tensor]:
    """Outputs and gradients; the loss touches o and, when returned, both final states."""
    states = kw.pop("states", True)
    magnitude = kw.pop("magnitude", False)  # the loss's state terms weighted by 1
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
        if magnitude:
            loss = loss + st.S.double().sum() + st.H.double().sum()
        else:
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
    dims: tuple[int, int], mode: str, num_threads: int,
) -> None:
    monkeypatch.setattr(kernels._tiles, "BLOCK_CAP", 16 if dims != (K, V) else 64)
    x = inputs(T, decay, seed=T, dims=dims)
    if opts.get("normalize"):  # the denominator sums positive terms
        x.update({n: x[n].abs() for n in ("q", "k", "S0", "eta0")})
    ref = run(hla_sp.hla2, x, torch.float64, **opts)
    torch32 = run(hla_sp.hla2, x, torch.float32, **opts)
    before = kernels.LAUNCHES[FUSED[mode]]
    got = run(hla2_fused, x, torch.float32, mode=mode, **opts)
    assert kernels.LAUNCHES[FUSED[mode]] == before + 1
    assert set(got) == set(ref)
    if opts.get("normalize"):
        mag = magnitudes_normalized(x, T, float(opts.get("ridge", 0.0)))
        d = 3 * depth(T, *dims, x["a"], CHUNK)  # the normaliser: one more stage
    else:
        mag = magnitudes(x, T, **opts)
        d = 2 * depth(T, *dims, x["a"], CHUNK)
    check_within_rounding(got, ref, mag, d)
    check_within_rounding(torch32, ref, mag, d)


@pytest.mark.parametrize("mode", ["chunked", "sequential"])
def test_fused_hla2_varlen(kernels: ModuleType, mode: str, num_threads: int) -> None:
    """Packed documents: starts cut both stages' carries (chunk-aligned start at 16)."""
    x = inputs(40, "token", seed=7)
    cu = torch.tensor([0, 5, 16, 40])
    ref = run(hla_sp.hla2, x, torch.float64, cu_seqlens=cu, states=False)
    torch32 = run(hla_sp.hla2, x, torch.float32, cu_seqlens=cu, states=False)
    before = kernels.LAUNCHES[FUSED[mode]]
    got = run(hla2_fused, x, torch.float32, cu_seqlens=cu, states=False, mode=mode)
    assert kernels.LAUNCHES[FUSED[mode]] == before + 1
    mag = magnitudes(x, 40, cu_seqlens=cu, states=False)
    d = 2 * depth(40, K, V, x["a"], CHUNK)
    check_within_rounding(got, ref, mag, d)
    check_within_rounding(torch32, ref, mag, d)
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
def test_fused_hla2_bf16_forward(kernels: ModuleType, mode: str, num_threads: int) -> None:
    """bf16: within 8 bf16 roundings of the magnitudes, elementwise, on top of the fp32
    accumulation's: the output and the stage-1 key k~ are rounded once, the dot
    operands of both stages once more, and k~'s error passes into the output through a
    second product."""
    x = inputs(33, "token", seed=9)
    xr = {n: t.to(torch.bfloat16).double() for n, t in x.items()}
    ref = run(hla_sp.hla2, xr, torch.float64)
    got = run(hla2_fused, x, torch.bfloat16, mode=mode)
    assert got["o"].dtype == torch.bfloat16
    mag = magnitudes(xr, 33)
    d = 2 * depth(33, K, V, xr["a"], CHUNK)
    for name in ("o", "S", "H"):
        assert_within_rounding(name, got[name], ref[name], mag[name],
                               {torch.float32: d, torch.bfloat16: 8})


def test_fused_hla2_needs_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    if DEVICE != "cpu":
        pytest.skip("CPU tensors without the interpreter")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 4, H, K)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        hla2_fused(q, q, q)


def test_fused_hla2_sequential_refuses_spilling_configurations(kernels: ModuleType) -> None:
    """Each configuration of the sequential kernel measured ahead of time to spill more
    than the limit per thread (``SEQUENTIAL_MEASURED``) is refused at the entry point,
    before any launch, naming the inputs, the arch and the default mode."""
    from hla_sp.kernels.hla2_fused import SEQUENTIAL_MEASURED, SPILL_LIMIT

    refused = [k for k, v in SEQUENTIAL_MEASURED.items() if max(v.values()) > SPILL_LIMIT]
    assert refused, "the table lists no refused configuration"
    dtypes = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
              "fp16": torch.float16}
    before_prec = torch.get_float32_matmul_precision()
    try:
        for name, BK, BV, decay, docs, states in refused:
            torch.set_float32_matmul_precision("high" if name == "tf32" else "highest")
            T, Hh = 5, 1
            q = torch.randn(1, T, Hh, BK, device=DEVICE).to(dtypes[name])
            v = torch.randn(1, T, Hh, BV, device=DEVICE).to(dtypes[name])
            kw: dict = {"mode": "sequential"}
            if decay:
                kw["log_decay"] = -torch.rand(1, T, Hh, device=DEVICE)
            if docs:
                kw["cu_seqlens"] = torch.tensor([0, 2, T], device=DEVICE)
            if states:
                kw["initial_state"] = hla_sp.HLA2State(
                    torch.zeros(1, Hh, BK, BK, device=DEVICE),
                    torch.zeros(1, Hh, BK, BV, device=DEVICE))
            launches = dict(kernels.LAUNCHES)
            with pytest.raises(ValueError) as err:
                hla2_fused(q, q, v, **kw)
            msg = str(err.value)
            for part in (f"{name} inputs", f"K = {BK}", f"V = {BV}", f"documents={docs}",
                         "per thread", 'mode="chunked"'):
                assert part in msg, (part, msg)
            assert any(arch in msg for arch in SEQUENTIAL_MEASURED[(name, BK, BV, decay, docs,
                                                                     states)])
            assert dict(kernels.LAUNCHES) == launches  # nothing ran
    finally:
        torch.set_float32_matmul_precision(before_prec)


def test_sequential_refuses_unmeasured_supersets_of_refused() -> None:
    """A configuration not measured ahead of time is refused when it has every input
    (decay, documents, states) of a measured one over the spill limit, and admitted
    when no such one exists; the message says it was not measured."""
    from hla_sp.kernels.hla2_fused import SEQUENTIAL_MEASURED, SPILL_LIMIT, sequential_refusal

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    refused = [k for k, v in SEQUENTIAL_MEASURED.items()
               if max(v.values()) > SPILL_LIMIT and k[0] in dtypes]
    assert refused
    checked = 0
    for name, BK, BV, decay, docs, states in refused:
        for extra in ((True, True, True),):
            key = (name, BK, BV, *extra)
            if key in SEQUENTIAL_MEASURED or not all(
                    b >= a for a, b in zip((decay, docs, states), extra)):
                continue
            msg = sequential_refusal(dtypes[name], BK, BV, *extra)
            assert msg is not None and "not measured" in msg, (key, msg)
            checked += 1
    assert checked
    # Nothing measured over the limit below it: admitted (bf16, K = 128, states alone).
    assert ("bf16", 128, 32, False, False, True) not in SEQUENTIAL_MEASURED
    assert sequential_refusal(torch.bfloat16, 128, 32, False, False, True) is None

"""The 16-bit fast path (``precision="fast"``) of hla2, ahla and hla3, and its rules.

- Resolution: "auto" is fast for 16-bit inputs on CUDA and exact elsewhere; fp32/fp64
  inputs are always exact; a bad value is refused by name.
- Structure: the fast path *is* the composition of public first-order calls on 16-bit
  tensors (each stage's output rounded once), bitwise, states and gradients included.
- Error: outputs, every input gradient and the final states are within flash-attention's
  rule of the fp64 result, twice the error of the naive form computed in bf16/fp16,
  on the torch path and on the Triton kernels (the interpreter on CPU).
- The exact path stays one option away and is unchanged: the fp32 computation, rounded
  once at the output.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import hla_sp
from hla_sp.config import HLAConfig
from hla_sp.nn import HLAHeads
from hla_sp.ops import dispatch as P
from hla_sp.ops import reference as R
from hla_sp.ops.dispatch import use_backend
from hla_sp.testing import assert_within_reference_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPS = {"hla2": hla_sp.hla2, "ahla": hla_sp.ahla, "hla3": hla_sp.hla3}
NAIVE = {"hla2": R.naive_hla2, "ahla": R.naive_ahla, "hla3": R.naive_hla3}


def test_resolution_rules() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert P.resolve("auto", torch.bfloat16, cuda) == "fast"
    assert P.resolve("auto", torch.float16, cuda) == "fast"
    assert P.resolve("auto", torch.bfloat16, cpu) == "exact"
    assert P.resolve("fast", torch.bfloat16, cpu) == "fast"
    assert P.resolve("fast", torch.float32, cuda) == "exact"  # fp32 stages are exact
    assert P.resolve("exact", torch.bfloat16, cuda) == "exact"
    assert P.stage_dtype("fast", torch.bfloat16) == torch.bfloat16
    assert P.stage_dtype("exact", torch.bfloat16) == torch.float32
    assert P.stage_dtype("exact", torch.float64) == torch.float64
    q = torch.zeros(1, 4, 1, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"precision: expected one of .*'auto'.* got 'half'"):
        hla_sp.hla2(q, q, q, precision="half")
    with pytest.raises(ValueError, match="precision: expected one of"):
        HLAHeads(2, 2, 8, precision="bf16")
    assert HLAConfig().precision == "auto"


def _inputs(dtype: torch.dtype, T: int = 80, H: int = 2, K: int = 16, seed: int = 0):
    torch.manual_seed(seed)
    q, k, v = (torch.randn(1, T, H, K).to(dtype).to(DEVICE) for _ in range(3))
    g = -0.05 * torch.rand(1, T, H).to(DEVICE)
    return q, k, v, g


def _by_hand(op: str, q, k, v, g, s0, scale: float):
    """The operator as public first-order calls on 16-bit tensors (the fast path's plan)."""
    la = hla_sp.linear_attention
    kw = dict(log_decay=g, scale=scale, output_final_state=True, chunk_size=32)
    if op == "hla2":
        kt, S = la(q, k, k, initial_state=s0[0], **kw)
        o, H = la(q, kt, v, initial_state=s0[1], **kw)
        return o, (S, H)
    if op == "ahla":
        u, C = la(q, k, v, initial_state=s0[0], **kw)
        o, H = la(q, k, u, initial_state=s0[1], **kw)
        return o, (C, H)
    kt, S = la(q, k, k, initial_state=s0[0], **kw)
    u, C = la(q, k, v, initial_state=s0[1], **kw)
    o, H = la(q, kt, u, initial_state=s0[2], **kw)
    return o, (S, C, H)


@pytest.mark.parametrize("op", list(OPS))
def test_fast_path_is_the_rounded_composition(op: str) -> None:
    """Bitwise: outputs, final states and all gradients (initial state included)."""
    q, k, v, g = _inputs(torch.bfloat16)
    K = q.shape[-1]
    n_fields = {"hla2": 2, "ahla": 2, "hla3": 3}[op]
    sym = torch.randn(1, 2, K, K, device=DEVICE) * 0.1
    s0 = [sym + sym.transpose(-1, -2)] + [torch.randn(1, 2, K, K, device=DEVICE) * 0.1
                                         for _ in range(n_fields - 1)]
    runs = []
    for fn in ("op", "hand"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, *s0)]
        lq, lk, lv, lg, *ls0 = leaves
        if fn == "op":
            o, st = OPS[op](lq, lk, lv, log_decay=lg, initial_state=tuple(ls0),
                            output_final_state=True, chunk_size=32, precision="fast")
            st = [x for x in st if x is not None]  # hla2's eta: without normalize, None
        else:
            o, st = _by_hand(op, lq, lk, lv, lg, ls0, K**-0.5)
        loss = o.float().pow(2).sum() + sum(x.pow(2).sum() for x in st)
        loss.backward()
        runs.append([o, *st, *(x.grad for x in leaves)])
    for a, b in zip(*runs, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _naive_stages(op: str, q, k, v, g):
    """The reference at the inputs' precision: the operator's stages, each the naive
    quadratic form in bf16/fp16 (so k~ and u are rounded once, as in the fast path).
    Returns (o, final states)."""
    la = R.naive_linear_attention
    kt, S = la(q, k, k, g)
    u, C = la(q, k, v, g)
    if op == "hla2":
        o, H = la(q, kt, v, g)
        return o, (S, H)
    if op == "ahla":
        o, H = la(q, k, u, g)
        return o, (C, H)
    o, H = la(q, kt, u, g)
    return o, (S, C, H)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("decay", [False, True], ids=["nodecay", "decay"])
@pytest.mark.parametrize("op", list(OPS))
def test_fast_path_error_within_twice_the_naive_form_at_that_precision(
        op: str, decay: bool, dtype: torch.dtype) -> None:
    _check_error_rule(op, decay, dtype)


def _fp64_on_torch(dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """The fp64 reference runs on the torch path (the kernels take no fp64)."""
    return use_backend("torch") if dtype == torch.float64 else contextlib.nullcontext()


def _check_error_rule(op: str, decay: bool, dtype: torch.dtype, T: int = 80) -> dict:
    q, k, v, g = _inputs(dtype, T=T)
    g = g if decay else None
    results = {}
    for name, dt in (("fast", dtype), ("low", dtype), ("fp64", torch.float64)):
        leaves = [x.to(dt).clone().requires_grad_() for x in (q, k, v)]
        gl = None if g is None else g.clone().to(torch.float64 if dt == torch.float64 else
                                        (torch.float32 if name == "fast" else dt))
        if gl is not None:
            gl.requires_grad_()
        if name == "low":
            o, states = _naive_stages(op, *leaves, gl)
        else:
            with _fp64_on_torch(dt):
                o, st = OPS[op](*leaves, log_decay=gl, output_final_state=True,
                                chunk_size=32, precision="fast")
            states = st[:] if op != "hla2" else st[:2]
        torch.manual_seed(1)
        do = torch.randn(o.shape, dtype=torch.float64).to(o.dtype).to(DEVICE)
        with _fp64_on_torch(dt):
            (o * do).sum().backward()
        grads = [x.grad for x in leaves] + ([] if gl is None else [gl.grad])
        results[name] = [o, *states, *grads]
    names = ["o", *(f"state{i}" for i in range(len(results["fp64"]) - 4 - (g is not None))),
             "dq", "dk", "dv"] + ([] if g is None else ["dlog_decay"])
    ratios = {}
    for i, n in enumerate(names):
        ratios[n] = assert_within_reference_error(
            f"{op} {n}", results["fast"][i], results["low"][i], results["fp64"][i])
    return ratios


def test_exact_path_is_one_option_away_and_unchanged() -> None:
    """precision="exact" on bf16 is the fp32 computation rounded once at the output."""
    q, k, v, g = _inputs(torch.bfloat16)
    for op, fn in OPS.items():
        o, _ = fn(q, k, v, log_decay=g, chunk_size=32, precision="exact")
        o32, _ = fn(q.float(), k.float(), v.float(), log_decay=g, chunk_size=32)
        assert torch.equal(o, o32.to(torch.bfloat16)), op
        auto, _ = fn(q, k, v, log_decay=g, chunk_size=32)  # CPU: exact, CUDA: fast
        same, _ = fn(q, k, v, log_decay=g, chunk_size=32,
                     precision="fast" if DEVICE == "cuda" else "exact")
        assert torch.equal(auto, same), op


@pytest.mark.parametrize("op", ["hla2", "hla3"])
def test_fast_path_on_the_kernels(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same rule on the Triton kernels (16-bit operands, fp32 accumulation); on CPU
    under the interpreter."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HLA_SP_BACKEND", "triton")
    _check_error_rule(op, True, torch.bfloat16, T=48)


def test_layer_fast_path_hands_16_bit_operands_to_the_operator() -> None:
    """The layer with precision="fast" runs the operator on bf16 q, k, v (rounded once
    after the convolution and norms) and stays within the rule against fp64."""
    torch.manual_seed(0)
    heads = HLAHeads(4, 2, 16, precision="fast")
    with torch.no_grad():
        heads.key_mix.fill_(0.5)  # the higher-order term on, not just the first order
    q = torch.randn(2, 40, 4, 16).bfloat16()
    k, v = torch.randn(2, 40, 2, 16).bfloat16(), torch.randn(2, 40, 2, 16).bfloat16()
    seen = []
    import hla_sp.nn.heads as heads_mod

    real = heads_mod.execute

    def spy(*a, **kw):
        seen.append((a[2].dtype, kw["precision"]))  # (spec, inputs, q, ...)
        return real(*a, **kw)

    heads_mod.execute = spy
    try:
        fast, _ = heads(q, k, v)
        exact, _ = heads.to(torch.float64)(q.double(), k.double(), v.double())
    finally:
        heads_mod.execute = real
    assert seen[0] == (torch.bfloat16, "fast") and seen[1][0] == torch.float64
    heads_exact = HLAHeads(4, 2, 16, precision="exact")
    heads_exact.load_state_dict(heads.state_dict())
    ex32, _ = heads_exact.float()(q, k, v)
    # bf16 operands: each of a handful of roundings costs at most 2^-8 relative
    err_fast = (fast.double() - exact).abs().max().item()
    err_exact = (ex32.double() - exact).abs().max().item()
    assert err_fast <= 8 * 2**-8 * exact.abs().max().item(), (err_fast, err_exact)

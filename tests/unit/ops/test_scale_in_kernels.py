"""q's scale rides into the kernels for every built-in operator: hla2 with ``ridge`` (its
ridge term takes the scale itself) and ccq (its first stage, whose output S q is a query
again, runs unscaled; a unit-normed mix of it gets its weight divided by the scale)
included. Each call must equal the same call with q scaled in PyTorch first (the entry's
``scale_in_kernels`` off), outputs, final states and every gradient, fp64 to 1e-12, and
q must reach the primitive unscaled: no pass of its own."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hla_sp.ops import runner, table
from hla_sp.ops.runner import run_operator

F64 = torch.float64
SCALE = 0.37
# (operator, its options, key_mix, value_mix, mix_norm)
CASES = {
    "hla2-ridge": ("hla2", {"ridge": 0.3}, True, False, False),
    "hla2-ridge-normalize": ("hla2", {"ridge": 0.3, "normalize": True}, False, False, False),
    "hla2-mixnorm": ("hla2", {}, True, False, True),
    "ccq": ("ccq", {}, False, False, False),
    "ccq-mix": ("ccq", {}, True, False, False),
    "ccq-mixnorm": ("ccq", {}, True, False, True),
    "hla3-mixnorm": ("hla3", {}, True, True, True),
    "ahla": ("ahla", {}, False, False, False),
}


def _call(case: str, G: int, docs: bool, *, inside: bool, monkeypatch: pytest.MonkeyPatch,
          seen: list[tuple[bool, float]] | None = None):
    name, opts, km, vm, norm = CASES[case]
    spec = table.TABLE[name]
    monkeypatch.setitem(table.TABLE, name, dataclasses.replace(spec, scale_in_kernels=inside))
    gen = torch.Generator().manual_seed(G + 2 * docs)
    B, T, Hkv, K, V = (1, 37, 2, 6, 5) if docs else (2, 37, 2, 6, 5)
    Hq = Hkv * G

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen, dtype=F64)

    q, k, v = r(B, T, Hq, K), r(B, T, Hkv, K) * 0.6, r(B, T, Hkv, V)
    g = -0.3 * r(B, T, Hkv).abs()
    wk = r(Hq) if km else None
    wv = r(Hq) if vm else None
    leaves = [t.requires_grad_(True) for t in (q, k, v, g)]
    cu = torch.tensor([0, 11, 20, 37]) if docs else None
    N = 3 if docs else B
    state = None
    if docs:
        state = []
        for field, shape in table.state_fields(name, N, Hq, Hkv, K, V, **opts).items():
            x = None if shape is None else r(*shape)
            if field == "S":
                x = x @ x.transpose(-1, -2)  # S must be symmetric
            state.append(x)
        state = tuple(state)
    real = runner.primitive

    def spy(qq, *a, **kw):
        if seen is not None:
            seen.append((qq is q, kw["scale"]))
        return real(qq, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(runner, "primitive", spy)
        o, st = run_operator(name, q, k, v, log_decay=g, scale=SCALE, key_mix=wk,
                             value_mix=wv, mix_norm=norm, cu_seqlens=cu, initial_state=state,
                             output_final_state=True, chunk_size=8, **opts)
    w = torch.randn(o.shape, generator=gen, dtype=F64)
    loss = (o * w).sum() + sum((s * s).sum() for s in st if s is not None)
    grads = torch.autograd.grad(loss, leaves)
    return [o, *(s for s in st if s is not None), *grads]


@pytest.mark.parametrize("docs", [False, True], ids=["batch", "docs+h0"])
@pytest.mark.parametrize("G", [1, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_scale_in_kernels_equals_scaling_first(case: str, G: int, docs: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[bool, float]] = []
    got = _call(case, G, docs, inside=True, monkeypatch=monkeypatch, seen=seen)
    want = _call(case, G, docs, inside=False, monkeypatch=monkeypatch)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert (a - b).abs().max() <= 1e-12 * b.abs().max(), f"output {i}"
    # q itself reaches the primitive (no scaled copy), and only at the call's scale,
    # except ccq's first stage (unscaled, its S q is a query again)
    first = [s for same, s in seen if same]
    assert first, "q never reached the primitive unscaled"
    assert all(s == SCALE for _, s in seen if CASES[case][0] != "ccq")
    if CASES[case][0] == "ccq":
        assert [s for _, s in seen] == [1.0, SCALE]


def test_a_zero_scale_with_the_unit_normed_query_mix(monkeypatch: pytest.MonkeyPatch) -> None:
    """scale 0 zeroes every query: ccq's output is zero and finite (the mix weight is
    not divided by the scale then), as with q scaled first."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 9, 2, 4, generator=gen, dtype=F64) for _ in range(3))
    o, _ = run_operator("ccq", q, k, v, scale=0.0, key_mix=torch.ones(2, dtype=F64),
                        mix_norm=True, chunk_size=8)
    assert torch.isfinite(o).all() and o.abs().max() == 0

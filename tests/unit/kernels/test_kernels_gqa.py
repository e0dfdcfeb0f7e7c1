"""The multi-query Triton kernels: G query heads read one kv head's states.

The kernels take q [B, T, H G, K] against k, v [B, T, H, .]: the chunk states and their
passing run once per kv head, each query head's programs read their kv head's states,
and dk, dv and the decay's dA are the sums of the group's per-query-head shares. On a
machine without CUDA they run under Triton's interpreter (``test_kernels.interp``).

Reference: the PyTorch multi-query path in fp64 (itself checked against the serial
recurrence to 1e-10 in tests/unit/ops/test_ops_gqa_mq.py). Tolerance: the rounding bound of
tests/unit/kernels/test_kernels.py (``depth`` fp32 roundings times the fp64 magnitude computed on
absolute values), with G more roundings for the sum of a group's shares.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_kernels import (
    DEVICE,
    abs_inputs,
    check_all,
    chunk_linear_attention,
    depth,
    interp,  # noqa: F401  (the fixture)
    run,
)

import hla_sp
from hla_sp.testing import decay_grad_magnitude

H, K, V = 2, 16, 32


def _inputs(T: int, G: int, decay: bool, seed: int) -> dict[str, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(DEVICE)

    g = (-0.5 * torch.rand(1, T, H, generator=gen, dtype=torch.float64)).to(DEVICE)
    return dict(q=rnd(1, T, H * G, K) * K**-0.5, k=rnd(1, T, H, K), v=rnd(1, T, H, V),
                g=g if decay else None, h0=rnd(1, H, K, V), do=rnd(1, T, H * G, V),
                dht=rnd(1, H, K, V))


def _magnitudes(x: dict, resets: torch.Tensor | None) -> dict[str, torch.Tensor]:
    ax = abs_inputs(x)
    mag = run(chunk_linear_attention, ax, torch.float64, use_h0=True, resets=resets)
    if "dg" in mag:
        loss = (mag["o"] * ax["do"]).sum((1, 3)).unflatten(1, (H, -1)).sum(-1) + (
            mag["h_T"] * ax["dht"]).sum((2, 3))
        mag["dg"] = decay_grad_magnitude(loss, tuple(x["g"].shape), x["g"].shape[1])
    return mag


@pytest.mark.parametrize(("G", "T", "decay", "docs"), [
    pytest.param(2, 37, True, True, id="G2-T37-decay-docs"),
    pytest.param(4, 33, False, False, id="G4-T33-nodecay"),
])
def test_multi_query_kernels(
    interp: SimpleNamespace, G: int, T: int, decay: bool, docs: bool  # noqa: F811
) -> None:
    x = _inputs(T, G, decay, seed=G)
    resets = None
    if docs:
        resets = torch.zeros(1, T, dtype=torch.bool, device=DEVICE)
        resets[0, [7, 16]] = True
    ref = run(chunk_linear_attention, x, torch.float64, use_h0=True, resets=resets)
    before = interp.launches()
    tri = run(interp.fn, x, torch.float32, use_h0=True, resets=resets)
    assert interp.launches() - before == 8, "the Triton kernels did not run"
    check_all(tri, ref, _magnitudes(x, resets), depth(T, K, V, x["g"]) + G)


def test_grouped_hla2_runs_the_multi_query_kernels(
    interp: SimpleNamespace, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """The public grouped call on the Triton backend runs no sub-tokens and equals the
    PyTorch backend's (fp32 both: a bound of fp32 roundings, 1e-4 relative, for two
    stages of sums over at most 40 terms of unit size)."""
    from hla_sp.ops import runner

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the shared stage interleaved sub-tokens")

    monkeypatch.setattr(runner, "_interleave", refuse)
    G, T = 2, 40
    x = _inputs(T, G, True, seed=11)
    q, k, v, g = (x[n].float() for n in ("q", "k", "v", "g"))
    before = interp.launches()
    o, _ = hla_sp.hla2(q, k, v, log_decay=g, chunk_size=16)
    assert interp.launches() > before
    monkeypatch.setenv("HLA_SP_BACKEND", "torch")
    o_ref, _ = hla_sp.hla2(q, k, v, log_decay=g, chunk_size=16)
    err = float((o - o_ref).abs().max())
    assert err <= 1e-4 * float(o_ref.abs().max()), err

"""``torch.vmap`` over the operators: N problems in one call of the chunk operator.

Training many small models at once (stacked weights, e.g. the seeds of a study) runs
the operators under vmap. The chunk operator's vmap rule folds the vmapped dimension
into the batch, so the N problems are one forward call and one backward call of N B
sequences, not N calls (vmap's fallback loop). Reference: the same calls one problem at
a time, in fp64 to 1e-10 relative (only the order of a few sums differs); outputs, final
states and every gradient.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_kernels import DEVICE, interp  # noqa: F401  (the fixture)

import hla_sp
from hla_sp.ops import chunk_op

N, B, T, H, K, V = 3, 2, 24, 2, 8, 8


def _problems(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = {n: torch.randn(N, B, T, H, d, generator=gen, dtype=torch.float64)
         for n, d in (("q", K), ("k", K), ("v", V))}
    x["g"] = -torch.rand(N, B, T, H, generator=gen, dtype=torch.float64) * 0.2
    return {n: t.to(dtype).requires_grad_() for n, t in x.items()}


def _hla2(q, k, v, g):
    o, state = hla_sp.hla2(q, k, v, log_decay=g, chunk_size=8, output_final_state=True)
    return o, state.S, state.H


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every run of the torch backend's forward and backward scans, with its batch."""
    calls: list[tuple[str, int]] = []
    for name in ("chunk_forward", "chunk_backward"):
        real = getattr(chunk_op, name)

        def spy(q, *a, _real=real, _name=name, **kw):
            calls.append((_name, q.shape[0]))
            return _real(q, *a, **kw)

        monkeypatch.setattr(chunk_op, name, spy)
    return calls


def test_vmapped_hla2_is_one_call_per_stage_and_equals_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = _problems(torch.float64)
    calls = _counting(monkeypatch)
    got = torch.vmap(_hla2)(x["q"], x["k"], x["v"], x["g"])
    w = [torch.randn_like(t) for t in got]
    sum((a * b).sum() for a, b in zip(got, w, strict=True)).backward()
    # two stages, each one forward and one backward call on all N B sequences
    assert calls == [("chunk_forward", N * B)] * 2 + [("chunk_backward", N * B)] * 2
    grads = {n: t.grad.clone() for n, t in x.items()}
    for t in x.values():
        t.grad = None
    for i in range(N):
        ref = _hla2(*(x[n][i] for n in ("q", "k", "v", "g")))
        for a, b in zip(got, ref, strict=True):
            assert _rel(a[i], b) <= 1e-10
        sum((a * b[i]).sum() for a, b in zip(ref, w, strict=True)).backward()
    for n, t in x.items():
        assert _rel(grads[n], t.grad) <= 1e-10, n


def test_a_shared_argument_is_broadcast_over_the_problems(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vmap over q alone (k, v and the decay shared by all N problems): still one call."""
    x = _problems(torch.float64, seed=1)
    calls = _counting(monkeypatch)
    k, v, g = x["k"][0], x["v"][0], x["g"][0]
    got = torch.vmap(lambda q: _hla2(q, k, v, g)[0])(x["q"])
    assert calls == [("chunk_forward", N * B)] * 2
    for i in range(N):
        assert _rel(got[i], _hla2(x["q"][i], k, v, g)[0]) <= 1e-10


def test_a_bad_decay_in_one_problem_is_refused_under_vmap() -> None:
    """The value checks see every problem's values (one host read for all of them)."""
    x = _problems(torch.float64, seed=2)
    g = x["g"].detach().clone()
    g[2, 1, 5, 0] = 0.5
    with pytest.raises(ValueError, match=r"log_decay: expected values <= 0.*max 0\.5"):
        torch.vmap(_hla2)(x["q"], x["k"], x["v"], g)


def test_vmapped_triton_backend_equals_its_loop(interp: SimpleNamespace) -> None:  # noqa: F811
    """On the Triton kernels (the interpreter here) the folded call equals the calls one
    problem at a time up to fp32 rounding: the same kernels over more programs, so 1e-5
    of the largest value bounds it (sums of at most 24 unit-size terms per stage)."""
    x = {n: t.detach().float().to(DEVICE) for n, t in _problems(torch.float32, 3).items()}
    before = interp.launches()
    got = torch.vmap(_hla2)(x["q"], x["k"], x["v"], x["g"])
    assert interp.launches() > before, "the Triton kernels did not run"
    for i in range(N):
        ref = _hla2(*(x[n][i] for n in ("q", "k", "v", "g")))
        for a, b in zip(got, ref, strict=True):
            assert _rel(a[i], b) <= 1e-5

"""The public operators take fewer kv heads than query heads (GQA/MQA).

With Hkv dividing H, query head h reads kv head h // (H / Hkv). Repeating k, v and the
decay per query head gives the same outputs, so the grouped call must equal the
public call on repeated inputs (outputs and every gradient), and its shared state
fields (S, C, h: built from k and v alone) must equal the repeated call's at one
query head per group. fp64, to 1e-12 relative: the same sums in another order.
"""

from __future__ import annotations

import pytest
import torch

import hla_sp
from hla_sp.config import BUILTIN_OPERATORS
from hla_sp.ops import operators, run_operator

B, T, H, HKV, K = 1, 19, 4, 2, 8
G = H // HKV


def _inputs(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, HKV, K, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, HKV, K, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, T, HKV, generator=gen, dtype=torch.float64)
    return [x.requires_grad_() for x in (q, k, v, g)]


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, (what, a.shape, b.shape)
    a, b = a.detach(), b.detach()
    assert float((a - b).abs().max()) <= 1e-12 * max(float(b.abs().max()), 1.0), what


@pytest.mark.parametrize("op", list(BUILTIN_OPERATORS))
def test_public_operator_takes_grouped_heads(op: str) -> None:
    fn = operators.get(op).public  # every built-in's public function, GQA through it
    q, k, v, g = _inputs(0)
    o, st = fn(q, k, v, log_decay=g, output_final_state=True)
    rq, rk, rv, rg = _inputs(0)
    rep = [x.repeat_interleave(G, dim=2) for x in (rk, rv, rg)]
    o_ref, st_ref = fn(rq, *rep[:2], log_decay=rep[2], output_final_state=True)
    _close(o, o_ref, "o")
    fields = [st] if isinstance(st, torch.Tensor) else list(st)
    ref_fields = [st_ref] if isinstance(st_ref, torch.Tensor) else list(st_ref)
    for f, r in zip(fields, ref_fields):
        if f is None:
            continue
        # A field over kv heads is the repeated call's field at the group's first head.
        _close(f, r[:, ::G] if f.shape[1] == HKV else r, "state")
    loss = o.square().sum() + sum(f.square().sum() for f in fields if f is not None)
    loss_ref = o_ref.square().sum() + sum(
        (r[:, ::G] if f.shape[1] == HKV else r).square().sum()
        for f, r in zip(fields, ref_fields) if f is not None)
    loss.backward()
    loss_ref.backward()
    for name, a, b in (("dq", q, rq), ("dk", k, rk), ("dv", v, rv), ("dg", g, rg)):
        _close(a.grad, b.grad, name)


def test_grouped_state_continues() -> None:
    """A grouped call's final state carries into the next call as one call over both."""
    q, k, v, g = (x.detach() for x in _inputs(1))
    cut = 7
    o, _ = hla_sp.hla2(q, k, v, log_decay=g)
    _, st1 = hla_sp.hla2(q[:, :cut], k[:, :cut], v[:, :cut], log_decay=g[:, :cut],
                         output_final_state=True)
    o2, _ = hla_sp.hla2(q[:, cut:], k[:, cut:], v[:, cut:], log_decay=g[:, cut:],
                        initial_state=st1)
    _close(o2, o[:, cut:], "o after the cut")


def test_public_call_is_the_runner() -> None:
    """The public call is the one runner (one code path), bit for bit."""
    q, k, v, g = (x.detach() for x in _inputs(2))
    a, _ = hla_sp.hla3(q, k, v, log_decay=g)
    b, _ = run_operator("hla3", q, k, v, log_decay=g)
    assert torch.equal(a, b)


def test_grouped_heads_must_divide() -> None:
    q, k, v, _ = (x.detach() for x in _inputs(3))
    k3 = torch.cat([k, k[:, :, :1]], dim=2)
    with pytest.raises(ValueError, match="k: expected a number of kv heads dividing Hq = 4, got 3"):
        hla_sp.hla2(q, k3, torch.cat([v, v[:, :, :1]], dim=2))

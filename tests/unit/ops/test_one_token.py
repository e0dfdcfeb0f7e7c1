"""The one-token step (decoding) against the chunk scan it replaces at T = 1.

Exact in fp64 to rounding; in fp32 and bf16 the two compute in fp32 with the same
products summed in another order (the scan pads to a chunk and runs batched matmuls),
so they agree to a few fp32 ulps of the output's scale: 1e-5 relative is 100x that. The
non-finite cases must give the same non-finite entries, output and state.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from hla_sp.ops.one_token import one_token
from hla_sp.ops.primitive import chunk_linear_attention_op, make_chunk_impl

B, H, K, V = 2, 3, 8, 5


def _inputs(dtype, g_kind, with_h0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, 1, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, 1, H, V, generator=gen, dtype=torch.float64)
    g = None
    if g_kind == "decay":
        g = -torch.rand(B, 1, H, generator=gen, dtype=torch.float64)
    elif g_kind == "reset":  # a hard reset on one head of one sequence
        g = -torch.rand(B, 1, H, generator=gen, dtype=torch.float64)
        g[1, 0, 2] = float("-inf")
    h0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64) if with_h0 else None
    return tuple(None if x is None else x.to(dtype) for x in (q, k, v, g, h0))


def _scan(q, k, v, g, h0):
    o, h, _ = chunk_linear_attention_op(q, k, v, g, None, h0, 16, "torch")
    return o, h


CASES = list(itertools.product(["none", "decay", "reset"], [False, True]))


@pytest.mark.parametrize("dtype,rel", [(torch.float64, 1e-12), (torch.float32, 1e-5),
                                       (torch.bfloat16, 1e-5)])
@pytest.mark.parametrize("g_kind,with_h0", CASES)
def test_one_token_equals_the_scan(dtype, rel, g_kind, with_h0):
    args = _inputs(dtype, g_kind, with_h0)
    o, h = one_token(*args)
    o_ref, h_ref = _scan(*args)
    assert o.dtype == o_ref.dtype and h.dtype == h_ref.dtype
    for a, b in ((o, o_ref), (h, h_ref)):
        assert a.shape == b.shape
        assert (a - b).abs().max() <= rel * b.abs().max(), (a - b).abs().max()


@pytest.mark.parametrize("where", ["q", "k", "v", "g", "h0"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("g_kind", ["decay", "reset"])
def test_non_finite_inputs_poison_as_the_scan_does(where, value, g_kind):
    q, k, v, g, h0 = _inputs(torch.float64, g_kind, True, seed=1)
    x = {"q": q, "k": k, "v": v, "g": g, "h0": h0}
    if where == "g" and value == float("-inf"):
        value = float("nan")  # -inf is a reset, not a poison: the reset case covers it
    x[where].view(-1)[0] = value  # sequence 0, head 0
    if where == "h0":  # and on the reset head of sequence 1: the reset cuts it
        x["h0"][1, 2, 0, 0] = value
    o, h = one_token(q, k, v, g, h0)
    o_ref, h_ref = _scan(q, k, v, g, h0)
    for a, b in ((o, o_ref), (h, h_ref)):
        fin = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), fin), (where, value)
        assert not fin.all() or (where == "q" and a is h)
        assert torch.allclose(a[fin], b[fin], rtol=1e-12, atol=1e-12)


def test_decode_impl_takes_the_step_only_without_autograd():
    """make_chunk_impl runs the step at T = 1 without autograd, the scan otherwise (so
    training keeps the scan's backward and segment-wide poisoning)."""
    impl = make_chunk_impl("torch")
    q, k, v, g, h0 = _inputs(torch.float64, "decay", True)
    with torch.no_grad():
        o1, h1 = impl(q, k, v, g, h0=h0, chunk_size=16)
    o2, h2 = one_token(q, k, v, g, h0)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    qg = q.clone().requires_grad_()
    o3, _ = impl(qg, k, v, g, h0=h0, chunk_size=16)
    # recorded through the scan's operator (the step would record einsum's backward)
    assert "chunk_linear_attention" in type(o3.grad_fn).__name__, type(o3.grad_fn).__name__
    o3.sum().backward()
    assert qg.grad is not None and torch.allclose(o3.detach(), o2, rtol=1e-12, atol=0)

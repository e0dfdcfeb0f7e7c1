"""Property tests: results do not depend on how the sequence is cut.

Chunk size (16, 32, 64) and the split point of state chaining only change rounding.
The ⊕ of segment summaries is associative and a summary of a concatenation is
the ⊕ of the summaries (the homomorphism sequence parallelism rests on).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from op_table import OPS_BY_NAME, make_inputs, rel_err

from hla_sp.ops.chunk import segment_summary

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)


@SETTINGS
@given(
    T=st.integers(1, 90),
    H=st.integers(1, 2),
    K=st.sampled_from([2, 4, 8]),
    V=st.sampled_from([1, 3, 8]),
    decay=st.sampled_from(["none", "head", "token"]),
    op=st.sampled_from(["linear", "hla2", "ahla", "hla3"]),
    seed=st.integers(0, 2**16),
)
def test_chunk_size_independence(T, H, K, V, decay, op, seed):
    o = OPS_BY_NAME[op]
    q, k, v, g = make_inputs(1, T, H, K, V, decay=decay, seed=seed)
    outs = [o.fast(q, k, v, g, None, True, c) for c in (16, 32, 64)]
    for out, st_ in outs[1:]:
        assert rel_err(out, outs[0][0]) < 1e-10
        for a, b in zip(st_, outs[0][1]):
            assert rel_err(a, b) < 1e-10


def _summary(k, v, g):
    h, a = segment_summary(k, v, g)
    return h, a


def _combine(x, y):
    """(h_A, a_A) ⊕ (h_B, a_B) = (exp(a_B) h_A + h_B, a_A + a_B): written here from
    docs/math.md section 4, independently of hla_sp.parallel, as the specification."""
    (hx, ax), (hy, ay) = x, y
    return torch.exp(ay)[..., None, None] * hx + hy, ax + ay


@SETTINGS
@given(
    cuts=st.lists(st.integers(0, 40), min_size=3, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_summary_is_a_homomorphism_and_oplus_is_associative(cuts, seed):
    L1, L2, L3 = (c + 1 for c in cuts)
    T = L1 + L2 + L3
    _, k, v, g = make_inputs(2, T, 2, 4, 3, seed=seed)
    parts = [(0, L1), (L1, L1 + L2), (L1 + L2, T)]
    x, y, z = (_summary(k[:, s:e], v[:, s:e], g[:, s:e]) for s, e in parts)
    whole = _summary(k, v, g)
    left = _combine(_combine(x, y), z)
    right = _combine(x, _combine(y, z))
    for a, b in zip(left, right):
        assert rel_err(a, b) < 1e-12
    for a, b in zip(left, whole):
        assert rel_err(a, b) < 1e-12


def test_summary_matches_the_final_state_of_the_primitive():
    import hla_sp

    q, k, v, g = make_inputs(2, 37, 3, 4, 5)
    _, final = hla_sp.linear_attention(q, k, v, log_decay=g, output_final_state=True)
    h, a = segment_summary(k, v, g)
    assert rel_err(h, final) < 1e-12
    assert rel_err(a, g.sum(1)) < 1e-12


@SETTINGS
@given(start=st.sampled_from([0.0, 1.0]), batch=st.sampled_from([(), (3,)]),
       seed=st.integers(0, 2**16))
def test_combine_vjp_equals_autograd(start, batch, seed):
    """The written-out VJP of ⊕ (run on ring/tree helper threads) is autograd's, exactly."""
    from hla_sp.parallel import summaries as S

    shape = S.SummaryShape(2, 3, 4, 5)
    gen = torch.Generator().manual_seed(seed)
    x, y, d = (torch.randn(*batch, shape.size, generator=gen, dtype=torch.float64)
               for _ in range(3))
    y[..., -1] = start
    x[..., -1] = 0.0
    xr, yr = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
    want = torch.autograd.grad(S.combine(shape, xr, yr), (xr, yr), d)
    got = S.combine_vjp(shape, x, y, d)
    for a, b in zip(got, want):
        assert torch.equal(a, b)

"""Every operator's fast path against its serial recurrence and its naive form.

fp64 checks are to 1e-10 relative. fp32 and bf16 follow flash-attention's rule:
the fast path may err against the fp64 truth by at most twice the error the
reference itself makes at that precision (on the same rounded inputs), plus the
fp32 rounding bound of the computation (``hla_sp.testing.rounding_bound``: n u M,
M the same computation in fp64 on absolute values), which is what a fast path that
accumulates in fp32 may differ by whatever the machine's summation order; no fixed
floor. They run at 1 and 2 threads.
"""

from __future__ import annotations

import math

import pytest
import torch
from op_table import OPS, OPS_BY_NAME, make_inputs, rel_err

from hla_sp.ops import reference as R
from hla_sp.testing import decay_grad_magnitude, rounding_bound

SHAPES = {
    "T1": (1, 1, 1, 4, 4),
    "T63_K8V5": (2, 63, 3, 8, 5),
    "T65_K16V32": (1, 65, 2, 16, 32),
    "T40_H1": (1, 40, 1, 8, 8),
}
DECAYS = ["none", "zero", "head", "token"]


def _states(op, N, H, K, V, seed=1):
    gen = torch.Generator().manual_seed(seed)
    shapes = op.state_shapes(N, H, K, V)
    out = [torch.randn(s, generator=gen, dtype=torch.float64) * 0.3 for s in shapes]
    # A reachable key moment S = sum k k^T is symmetric: make the S fields so.
    out = [x @ x.transpose(-1, -2) if s[-1] == s[-2] == K else x for x, s in zip(out, shapes)]
    if op.positive:  # keep normalize's denominator positive
        out = [x.abs() for x in out]
    return out


def _loss_weights(o, states, seed=2):
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    ds = [torch.randn(s.shape, generator=gen, dtype=torch.float64) for s in states]
    return do, ds


def _grads(fn, inputs, do, ds):
    """Gradients of sum(o * do) + sum(state * ds) w.r.t. every input that needs them."""
    o, st = fn(*inputs)
    loss = (o.double() * do).sum() + sum((s.double() * d).sum() for s, d in zip(st, ds))
    leaves = [x for x in _flat(inputs) if x is not None and x.requires_grad]
    return o, st, torch.autograd.grad(loss, leaves)


def _flat(inputs):
    for x in inputs:
        if isinstance(x, (list, tuple)):
            yield from x
        else:
            yield x


def _leaf(x):
    return None if x is None else x.detach().clone().requires_grad_(True)


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_fp64_matches_recurrence_and_naive(op, shape, decay):
    B, T, H, K, V = SHAPES[shape]
    q, k, v, g = make_inputs(B, T, H, K, V, decay=decay, positive=op.positive)
    init = _states(op, B, H, K, V)
    ins_fast = [_leaf(x) for x in (q, k, v, g)] + [[_leaf(s) for s in init]]
    ins_ref = [_leaf(x) for x in (q, k, v, g)] + [[_leaf(s) for s in init]]
    o_ref, st_ref = op.recurrent(*ins_ref)
    do, ds = _loss_weights(o_ref, st_ref)

    def fast(q, k, v, g, init):
        return op.fast(q, k, v, g, init, True, 16)

    o, st, grads = _grads(fast, ins_fast, do, ds)
    o_ref, st_ref, grads_ref = _grads(op.recurrent, ins_ref, do, ds)
    assert rel_err(o, o_ref) < 1e-10
    for a, b in zip(st, st_ref):
        assert rel_err(a, b) < 1e-10
    names = ["q", "k", "v", "log_decay"][: 3 + (g is not None)] + [f"state{i}" for i in range(9)]
    for name, a, b in zip(names, grads, grads_ref):
        assert rel_err(a, b) < 1e-10, name
    # The naive quadratic form (no initial state).
    o0, _ = op.fast(q, k, v, g, None, False, 16)
    assert rel_err(o0, op.naive(q, k, v, g)) < 1e-10


@pytest.mark.parametrize("chunk", [1, 16, 32, 64, 128])
def test_chunk_size_only_changes_rounding(chunk):
    op = OPS_BY_NAME["hla2"]
    q, k, v, g = make_inputs(1, 100, 2, 8, 8)
    o, st = op.fast(q, k, v, g, None, True, chunk)
    o_ref, st_ref = op.recurrent(q, k, v, g)
    assert rel_err(o, o_ref) < 1e-10
    assert rel_err(st[1], st_ref[1]) < 1e-10


def _reference_error(op, dtype, q, k, v, g):
    """Error of the naive form evaluated in ``dtype`` against itself in fp64."""
    rq, rk, rv, rg = (None if x is None else x.to(dtype) for x in (q, k, v, g))
    truth = op.naive(*(None if x is None else x.double() for x in (rq, rk, rv, rg)))
    return truth, rel_err(op.naive(rq, rk, rv, rg), truth)


def _roundings(op, T: int, K: int, V: int, g: torch.Tensor, chunk: int) -> int:
    """Most fp32 roundings along one term's path, per stage as in tests/unit/kernels/test_kernels.py
    (casts, dots over K and V, sums over T tokens, decay exponents over a chunk)
    times the operator's stages (hla3: three; the normaliser: one more)."""
    stages = {"linear": 1, "hla3": 3}.get(op.name, 2) + (op.name == "hla2_norm")
    tile = max(chunk, 16)
    per_stage = 2 * (K + V + T) + 2 * tile * math.ceil(tile * float(g.abs().max())) + 16
    return stages * per_stage


def _magnitudes(op, q, k, v, g, do):
    """fp64 sums of the magnitudes of the terms of o and of each gradient (q, k, v, g)
    of (o * do).sum(): the computation on |q|, |k|, |v|, |do| (decay weights are
    positive). With the normaliser, o = N / D: |dN| / D + |o| |dD| / D."""
    xs = [x.detach().abs().requires_grad_(True) for x in (q, k, v)]
    ad = do.abs()
    if op.name == "hla2_norm":  # q, k >= 0 here: N and D sum positive terms
        N = R.naive_hla2(*xs, g)
        D = R.naive_hla2(xs[0], xs[1], torch.ones_like(xs[2][..., :1]), g) + 1e-6
        o = N / D.detach()
        loss_terms = 2 * (o.detach() * ad).sum((1, 3))
        loss = (o * ad).sum() + (o.detach() * ad * D / D.detach()).sum()
    else:
        o = op.naive(*xs, g)
        loss_terms = (o.detach() * ad).sum((1, 3))
        loss = (o * ad).sum()
    loss.backward()
    T = q.shape[1]
    dg = decay_grad_magnitude(loss_terms, tuple(g.shape), T, stages=2)
    return o.detach(), [x.grad for x in xs] + [dg]


def _floor(magnitude: torch.Tensor, truth: torch.Tensor, n: int) -> float:
    """The fp32 rounding bound n u M, relative to max|truth| as rel_err is."""
    bound = rounding_bound(magnitude, {torch.float32: n}).max()
    return float(bound / truth.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_low_precision_within_reference_error(op, dtype, num_threads):
    q, k, v, g = make_inputs(2, 127, 2, 16, 16, decay="token", positive=op.positive)
    qd, kd, vd, gd = (x.to(dtype) for x in (q, k, v, g))
    truth, ref_err = _reference_error(op, dtype, q, k, v, g)
    o, _ = op.fast(qd, kd, vd, gd, None, False, 32)
    assert o.dtype == dtype
    # Our path accumulates in fp32 and rounds once at the output, so it should not
    # err more than the reference does when it works at `dtype` throughout (the
    # factor 2), give or take its own fp32 rounding (on the rounded inputs).
    qr, kr, vr, gr = (x.double() for x in (qd, kd, vd, gd))
    mag, _ = _magnitudes(op, qr, kr, vr, gr, torch.ones_like(truth))
    floor = _floor(mag, truth, _roundings(op, q.shape[1], 16, 16, gr, 32))
    assert rel_err(o, truth) <= 2 * ref_err + floor, (rel_err(o, truth), ref_err, floor)


@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_fp32_gradients_within_reference_error(op, num_threads):
    q, k, v, g = make_inputs(1, 70, 2, 8, 8, decay="token", positive=op.positive)
    do = torch.randn(1, 70, 2, 8, dtype=torch.float64)

    def grads(fn, dtype):
        xs = [x.detach().to(dtype).clone().requires_grad_(True) for x in (q, k, v, g)]
        (fn(*xs).double() * do).sum().backward()
        return [x.grad.double() for x in xs]

    truth = grads(op.naive, torch.float64)
    ref32 = grads(op.naive, torch.float32)
    fast32 = grads(lambda *xs: op.fast(*xs, None, False, 16)[0], torch.float32)
    _, mags = _magnitudes(op, q, k, v, g, do)
    n = 2 * _roundings(op, 70, 8, 8, g, 16)  # the backward doubles each path
    for name, t, r, f, m in zip("qkvg", truth, ref32, fast32, mags):
        floor = _floor(m, t, n)
        assert rel_err(f, t) <= 2 * rel_err(r, t) + floor, (name, rel_err(f, t),
                                                              rel_err(r, t), floor)


@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_two_pieces_equal_the_whole(op):
    """Running [0, s) then [s, T) from the returned state equals one run, grads too."""
    q, k, v, g = make_inputs(2, 50, 2, 8, 6, positive=op.positive)
    s = 23
    xs = [x.clone().requires_grad_(True) for x in (q, k, v, g)]
    o_whole, st_whole = op.fast(*xs, None, True, 16)
    do = torch.randn_like(o_whole)
    ds = [torch.randn_like(x) for x in st_whole]
    loss = (o_whole * do).sum() + sum((a * b).sum() for a, b in zip(st_whole, ds))
    g_whole = torch.autograd.grad(loss, xs)

    ys = [x.clone().requires_grad_(True) for x in (q, k, v, g)]
    o1, st1 = op.fast(*(y[:, :s] for y in ys), None, True, 16)
    o2, st2 = op.fast(*(y[:, s:] for y in ys), list(st1), True, 16)
    o_pieces = torch.cat([o1, o2], 1)
    assert rel_err(o_pieces, o_whole) < 1e-10
    for a, b in zip(st2, st_whole):
        assert rel_err(a, b) < 1e-10
    loss = (o_pieces * do).sum() + sum((a * b).sum() for a, b in zip(st2, ds))
    for a, b in zip(torch.autograd.grad(loss, ys), g_whole):
        assert rel_err(a, b) < 1e-10


@pytest.mark.parametrize("with_init", [False, True], ids=["zero_init", "init"])
@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_varlen_equals_per_document_loop(op, with_init):
    cu = torch.tensor([0, 1, 17, 18, 40, 75, 76])  # length-1 documents included
    T, H, K, V = 76, 2, 8, 4
    q, k, v, g = make_inputs(1, T, H, K, V, positive=op.positive)
    N = cu.numel() - 1
    init = _states(op, N, H, K, V) if with_init else None
    xs = [x.clone().requires_grad_(True) for x in (q, k, v, g)]
    o, st = op.fast(*xs, init, True, 16, cu_seqlens=cu)
    do = torch.randn_like(o)
    ds = [torch.randn_like(x) for x in st]
    loss = (o * do).sum() + sum((a * b).sum() for a, b in zip(st, ds))
    grads = torch.autograd.grad(loss, xs)

    ys = [x.clone().requires_grad_(True) for x in (q, k, v, g)]
    outs, finals = [], []
    for i in range(N):
        s, e = cu[i].item(), cu[i + 1].item()
        doc_init = None if init is None else [x[i : i + 1] for x in init]
        o_i, st_i = op.recurrent(*(y[:, s:e] for y in ys), doc_init)
        outs.append(o_i)
        finals.append(st_i)
    o_ref = torch.cat(outs, 1)
    st_ref = [torch.cat([f[j] for f in finals], 0) for j in range(len(st))]
    assert rel_err(o, o_ref) < 1e-10
    for a, b in zip(st, st_ref):
        assert rel_err(a, b) < 1e-10
    loss = (o_ref * do).sum() + sum((a * b).sum() for a, b in zip(st_ref, ds))
    for name, a, b in zip("qkvg", grads, torch.autograd.grad(loss, ys)):
        assert rel_err(a, b) < 1e-10, name


@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_gradcheck_fp64(op):
    q, k, v, g = make_inputs(1, 9, 1, 3, 2, positive=op.positive)
    init = _states(op, 1, 1, 3, 2)
    xs = [x.clone().requires_grad_(True) for x in (q, k, v, g, *init)]

    def fn(q, k, v, g, *init):
        # gradcheck perturbs one entry at a time; a key moment S0 must stay symmetric
        # (the operators refuse another), so it enters through its symmetric part.
        init = [(x + x.mT) / 2 if x.shape[-2:] == (3, 3) else x for x in init]
        o, st = op.fast(q, k, v, g, init, True, 4)
        return (o, *st)

    assert torch.autograd.gradcheck(fn, xs, eps=1e-6, atol=1e-8)


def test_hla2_gamma_one_equals_paper_masked_loop():
    from hla_sp.ops.reference import paper_hla2_masked_loop

    q, k, v, _ = make_inputs(2, 45, 3, 8, 5)
    o, _ = OPS_BY_NAME["hla2"].fast(q, k, v, None, None, False, 16)
    assert rel_err(o, paper_hla2_masked_loop(q, k, v)) < 1e-10


def test_scale_multiplies_queries():
    import hla_sp

    q, k, v, g = make_inputs(1, 20, 2, 8, 8)
    a, _ = hla_sp.hla2(q, k, v, log_decay=g, scale=0.37)
    b, _ = hla_sp.hla2(q * 0.37, k, v, log_decay=g, scale=1.0)
    assert rel_err(a, b) < 1e-12
    c, _ = hla_sp.hla2(q, k, v, log_decay=g)  # default K ** -0.5
    d, _ = hla_sp.hla2(q * 8**-0.5, k, v, log_decay=g, scale=1.0)
    assert rel_err(c, d) < 1e-12


def test_final_state_dtype_is_fp32_for_bf16_inputs():
    import hla_sp

    q, k, v, g = make_inputs(1, 10, 1, 4, 4, dtype=torch.bfloat16)
    o, st = hla_sp.hla2(q, k, v, log_decay=g, output_final_state=True)
    assert o.dtype == torch.bfloat16
    assert st.S.dtype == torch.float32 and st.H.dtype == torch.float32


def test_chunk_path_on_an_empty_shard_passes_the_carry_through():
    """Sequence parallelism can hand a rank zero tokens; the chunk path must cope."""
    from hla_sp.ops.primitive import make_chunk_impl

    chunk_linear_attention = make_chunk_impl("torch")
    h0 = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    empty = torch.zeros(2, 0, 3, 4, dtype=torch.float64)
    o, h = chunk_linear_attention(empty, empty, empty[..., :1].expand(2, 0, 3, 5), None, h0=h0)
    assert o.shape == (2, 0, 3, 5)
    assert torch.equal(h, h0)

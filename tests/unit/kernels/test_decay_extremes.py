"""Hard resets (log_decay = -inf) and huge decays at one token, mid-chunk (issue 10 item 2).

Every in-chunk weight is the exp of a segment sum, so a decay of -1e30 at one token
cannot swamp the small decays around it (as a difference of prefix sums does), and
-inf gives weights of exactly 0 rather than NaN (-inf - -inf). Checked for all four
operators, outputs, final states and gradients, against the fp64 serial recurrence:
fp64 to 1e-10 relative; fp32 within the error the fp32 serial recurrence itself makes
on the same rounded inputs (flash-attention's rule, as in test_ops.py).
"""

from __future__ import annotations

import pytest
import torch
from op_table import OPS_BY_NAME, make_inputs, rel_err

import hla_sp
from hla_sp.config import SP_METHODS

EXTREMES = [float("-inf"), -1e4, -1e6, -1e30]
NAMES = ["linear", "hla2", "ahla", "hla3"]
T, CHUNK = 40, 16  # the huge decay at token 21: the middle of the second chunk


def _inputs(op, value: float, dtype: torch.dtype):
    q, k, v, g = make_inputs(2, T, 2, 8, 6, decay="token", positive=op.positive)
    g = g.clone()
    g[0, 21, 0] = value  # one head of one sequence, mid-chunk
    g[1, 5, 1] = value  # and one in the first chunk of the other
    return [x.to(dtype) for x in (q, k, v, g)]


def _run(fn, xs, do, ds):
    """Outputs, final states and the gradients of sum(o do) + sum(state ds)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in xs]
    o, st = fn(*leaves)
    loss = (o.double() * do).sum() + sum((s.double() * d).sum() for s, d in zip(st, ds))
    return [o, *st, *torch.autograd.grad(loss, leaves)]


def _fast(op):
    return lambda q, k, v, g: op.fast(q, k, v, g, None, True, CHUNK)


def _cotangents(op, xs):
    o, st = op.recurrent(*xs)
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    return do, [torch.randn(s.shape, generator=gen, dtype=torch.float64) for s in st]


@pytest.mark.parametrize("value", EXTREMES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_fp64_exact(name, value):
    op = OPS_BY_NAME[name]
    xs = _inputs(op, value, torch.float64)
    do, ds = _cotangents(op, xs)
    got = _run(_fast(op), xs, do, ds)
    ref = _run(op.recurrent, xs, do, ds)
    labels = ["o"] + [f"state{i}" for i in range(len(ds))] + ["dq", "dk", "dv", "dlog_decay"]
    for label, a, b in zip(labels, got, ref):
        assert torch.isfinite(a).all(), label
        assert rel_err(a, b) <= 1e-10, (label, rel_err(a, b))


@pytest.mark.parametrize("value", EXTREMES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_fp32_within_reference_error(name, value):
    op = OPS_BY_NAME[name]
    x32 = _inputs(op, value, torch.float32)
    x64 = [x.double() for x in x32]  # the same rounded inputs, in fp64: the truth
    do, ds = _cotangents(op, x64)
    truth = _run(op.recurrent, x64, do, ds)
    ref32 = _run(op.recurrent, x32, do, ds)
    got = _run(_fast(op), x32, do, ds)
    labels = ["o"] + [f"state{i}" for i in range(len(ds))] + ["dq", "dk", "dv", "dlog_decay"]
    floor = 4 * torch.finfo(torch.float32).eps
    for label, f, r, t in zip(labels, got, ref32, truth):
        assert torch.isfinite(f).all(), label
        assert rel_err(f, t) <= 2 * rel_err(r, t) + floor, (label, rel_err(f, t), rel_err(r, t))


@pytest.mark.parametrize("value", [float("-inf"), -1e30])
def test_hard_reset_forgets_everything(value):
    """After a -inf (or -1e30) at token s, the outputs from s on equal a fresh start at s
    that sees only the tokens from s on: a reset, exactly."""
    q, k, v, g = make_inputs(1, T, 2, 8, 6, decay="token")
    g = g.clone()
    s = 21
    g[0, s, :] = value
    o, _ = hla_sp.hla2(q, k, v, log_decay=g, chunk_size=CHUNK)
    g_tail = g[:, s:].clone()
    g_tail[:, 0] = 0.0  # a fresh start has no state for the decay to act on
    o_tail, _ = hla_sp.hla2(q[:, s:], k[:, s:], v[:, s:], log_decay=g_tail, chunk_size=CHUNK)
    assert rel_err(o[:, s:], o_tail) <= 1e-12


@pytest.mark.parametrize("value", EXTREMES, ids=str)
def test_varlen_fp64_exact(value):
    """Packed documents with the huge decay inside a document, and a final state each."""
    op = OPS_BY_NAME["hla2"]
    q, k, v, g = _inputs(op, value, torch.float64)
    q, k, v, g = (x[:1] for x in (q, k, v, g))
    cu = torch.tensor([0, 13, T])
    o, st = hla_sp.hla2(q, k, v, log_decay=g, cu_seqlens=cu, output_final_state=True,
                        chunk_size=CHUNK)
    for i, (s, e) in enumerate([(0, 13), (13, T)]):
        o_ref, st_ref = op.recurrent(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e])
        assert rel_err(o[:, s:e], o_ref) <= 1e-10
        assert rel_err(st[1][i : i + 1], st_ref[1]) <= 1e-10


def test_validation_accepts_minus_inf_refuses_nan_and_plus_inf():
    q, k, v, g = make_inputs(1, 8, 1, 4, 4, decay="token")
    g = g.clone()
    g[0, 3, 0] = float("-inf")
    o, _ = hla_sp.linear_attention(q, k, v, log_decay=g)
    assert torch.isfinite(o).all()
    for bad in (float("nan"), float("inf"), 0.5):
        g2 = g.clone()
        g2[0, 5, 0] = bad
        with pytest.raises(ValueError, match="log_decay"):
            hla_sp.linear_attention(q, k, v, log_decay=g2)


def extreme_sp_task(rank: int, P: int, cases: list[dict]) -> list[str]:
    """World task: :func:`parallel_cases.run_cases` with one token's log-decay replaced
    by ``case["extreme"]`` (at ``case["at"]``, batch 0, head 0) in every dtype."""
    import parallel_cases as pc

    make = pc._inputs

    def inputs(c: dict, dtype: torch.dtype) -> dict:
        x = make(c, dtype)
        g = x["g"].clone()
        g[0, c["at"], 0] = c["extreme"]
        x["g"] = g
        return x

    pc._inputs = inputs
    try:
        return pc.run_cases(rank, P, cases)
    finally:
        pc._inputs = make


@pytest.mark.timeout(400)
def test_sequence_parallel_exact(world):
    """Two ranks: the huge decay sits mid-chunk in rank 0's shard, so it enters rank 0's
    summary, the cross-rank carry and its backward (fp64 to 1e-10, fp32 within the
    single-process error, as tests/unit/parallel/test_primitive.py)."""
    from parallel_cases import OPS, case

    cases = []
    for i, (name, value) in enumerate((n, x) for n in OPS for x in EXTREMES):
        method = SP_METHODS[i % len(SP_METHODS)]
        for dtype in ("float64", "float32"):
            cases.append(case(name, T=24, chunk=8, decay="token", h0=True, final=True,
                              method=method, dtype=dtype, extreme=value, at=5, seed=i,
                              cu=[0, 9, 24] if i % 2 else None))
    errors = world(2).run(extreme_sp_task, cases, timeout=360)
    flat = [e for rank_errors in errors for e in rank_errors]
    assert not flat, "\n".join(flat[:20])

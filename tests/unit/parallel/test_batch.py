"""A plan per batch: :func:`hla_sp.ops.sharding.plan_documents` on one process,
:meth:`hla_sp.SequenceParallel.plan_batch` on a group.

The plan path is the same computation as the ``cu_seqlens`` path (the offsets reach
the same code as the same Python ints), so outputs, final states and gradients are
compared for equality, not to a tolerance. Counts (:func:`hla_sp.testing.counting`)
are exact: building a plan reads the host at most once, and the layers and operators
given a plan read nothing on the host for the documents.
"""

from __future__ import annotations

import pytest
import torch

import hla_sp
from hla_sp.ops.sharding import BatchPlan, plan_documents
from hla_sp.testing import counting

T, HIDDEN, HEADS, HEAD_DIM = 24, 16, 4, 4
CU = [0, 5, 13, T]
OPS = {"linear_attention": hla_sp.linear_attention, "hla2": hla_sp.hla2,
       "ahla": hla_sp.ahla, "hla3": hla_sp.hla3}


def _layer(kv: int, decay: str = "none"):
    from hla_sp.nn import HLAttention

    torch.manual_seed(3)
    m = HLAttention(HIDDEN, HEADS, HEAD_DIM, kv, decay=decay, chunk_size=8).double()
    with torch.no_grad():  # zero at init: give the first-order path's weights values
        for p in (m.heads.key_mix, m.heads.value_mix):
            if p is not None:
                torch.nn.init.normal_(p)
    return m


def _run(m, x: torch.Tensor, **kw) -> list[torch.Tensor]:
    """Output, final state and every gradient of one forward and backward."""
    m.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y, st = m(x, output_final_state=True, **kw)
    (y.square().sum() + sum(t.sum() for t in _flat(st))).backward()
    return [y.detach(), *_flat(st), x.grad] + [p.grad for p in m.parameters()]


def _flat(state: object) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state.detach()]
    return [t for s in state or () for t in _flat(s)]


def test_plan_documents_holds_python_ints() -> None:
    with counting() as reads:
        plan = plan_documents(torch.tensor(CU), T)
    assert reads == {"tolist": 1}
    assert plan.bounds == tuple(CU) and plan.T == plan.T_local == T and plan.n_docs == 3
    assert plan_documents(CU, T).digest == plan.digest != plan_documents([0, 6, 13, T], T).digest
    doubled = plan * 2  # GQA's interleaved sub-tokens
    assert doubled.bounds == tuple(2 * c for c in CU) and doubled.T_local == 2 * T
    assert plan_documents(None, T).bounds is None


@pytest.mark.parametrize(("cu", "T_", "error", "text"), [
    ([1, 5, T], T, ValueError, "cu_seqlens: expected cu_seqlens[0] == 0, got cu_seqlens[0] = 1"),
    ([0, 5, T - 1], T, ValueError, f"expected cu_seqlens[-1] == T = {T}"),
    ([0, 5, 5, T], T, ValueError, "strictly increasing offsets, got cu_seqlens[1] = 5"),
    (torch.tensor([0.0, T]), T, TypeError, "cu_seqlens: expected dtype int32 or int64"),
    ([0], T, ValueError, "N + 1 >= 2 offsets"),
    (CU, -1, ValueError, "T: expected an int >= 0"),
])
def test_plan_documents_checks(cu, T_, error, text) -> None:
    with pytest.raises(error) as e:
        plan_documents(cu, T_)
    assert text in str(e.value)


def test_operators_check_the_plan() -> None:
    q = torch.randn(1, T, 2, 4)
    plan = plan_documents(CU, T)
    with pytest.raises(ValueError, match="plan: expected inputs of local length T = 23, got a "
                                         f"plan built for T_local = {T}"):
        hla_sp.hla2(q[:, 1:], q[:, 1:], q[:, 1:], plan=plan)
    with pytest.raises(ValueError, match="cu_seqlens: expected None when plan is given"):
        hla_sp.linear_attention(q, q, q, plan=plan, cu_seqlens=torch.tensor(CU))
    with pytest.raises(TypeError, match="plan: expected a BatchPlan"):
        hla_sp.ahla(q, q, q, plan=CU)
    with pytest.raises(ValueError, match="q: expected batch size B == 1 when the plan has"):
        hla_sp.hla3(q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1),
                    plan=plan)


@pytest.mark.parametrize("name", list(OPS))
def test_operators_with_plan_equal_cu_seqlens(name: str) -> None:
    """Same outputs and final states, and no host read at all with the plan."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, T, 2, 4, dtype=torch.float64, generator=g) for _ in range(3))
    want = OPS[name](q, k, v, cu_seqlens=torch.tensor(CU), output_final_state=True)
    plan = plan_documents(torch.tensor(CU), T)
    with counting() as reads:
        got = OPS[name](q, k, v, plan=plan, output_final_state=True)
    assert reads == {}
    for a, b in zip(_flat(got), _flat(want)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kv", [4, 2], ids=["MHA", "GQA"])
def test_layer_with_plan_equals_cu_seqlens(kv: int) -> None:
    """The layer (short conv, first-order path, GQA): equal outputs, states and
    gradients; forward + backward read nothing on the host (decay "none": a log_decay's
    sign check is the one host read of one process, and is not about documents)."""
    m = _layer(kv)
    x = torch.randn(1, T, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    want = _run(m, x, cu_seqlens=torch.tensor(CU))
    plan = plan_documents(torch.tensor(CU), T)
    with counting() as reads:
        got = _run(m, x, plan=plan)
    assert reads == {}
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ---- under sequence parallelism (2 gloo ranks) ----

P = 2
SP_CASES = [  # (layout, local lengths or None (even), offsets)
    ("zigzag", None, [0, 9, 23, 40]),
    ("contiguous", [13, 27], [0, 9, 23, 40]),
    ("contiguous", [25, 15], None),
]


def _sp_task(rank: int, world_size: int, layout: str, lengths, cu) -> dict:
    from hla_sp import SequenceParallel
    from hla_sp.parallel import shard

    m = _layer(2, decay="learned")
    Tg = 40
    x = torch.randn(1, Tg, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    kw = {} if lengths is None else {"lengths": lengths}
    xs = shard(x, rank, world_size, layout, **kw)
    cu_t = None if cu is None else torch.tensor(cu)
    out: dict = {}
    if rank == 0:
        out["ref"] = _run(m, x, cu_seqlens=cu_t)
    sp = SequenceParallel(layout=layout)
    want = _run(m, xs, sp=sp, cu_seqlens=cu_t)
    with counting() as build:
        plan = sp.plan_batch(xs.shape[1], cu_t)
    out["build"] = dict(build)
    _run(m, xs, sp=sp, plan=plan)  # the first call of each kind runs the full check
    with counting() as steady:
        got = _run(m, xs, sp=sp, plan=plan)
    out["steady"] = {k: n for k, n in steady.items() if k in ("item", "tolist", "cpu")}
    out["equal"] = [torch.equal(a, b) for a, b in zip(got, want)] + [len(got) == len(want)]
    out["y"] = got[0]
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("layout", "lengths", "cu"), SP_CASES,
                         ids=[f"{c[0]}{'-varlen' if c[2] else ''}" for c in SP_CASES])
def test_plan_batch_under_sp(world, layout, lengths, cu) -> None:
    """plan_batch: one all-gather and one host read; the layer given it equals the
    layer given cu_seqlens (exactly) and the one-process layer (fp64, 1e-9: sums in
    another order), and reads nothing on the host in steady state."""
    from hla_sp.parallel import shard

    outs = world(P).run(_sp_task, layout, lengths, cu, timeout=540)
    kw = {} if lengths is None else {"lengths": lengths}
    for r, o in enumerate(outs):
        assert o["build"] == {"all_gather": 1, "tolist": 1}, o["build"]
        assert o["steady"] == {}, o["steady"]
        assert all(o["equal"]), o["equal"]
        torch.testing.assert_close(o["y"], shard(outs[0]["ref"][0], r, P, layout, **kw),
                                   rtol=1e-9, atol=1e-9)


def _mismatch_task(rank: int, world_size: int) -> list[str]:
    from hla_sp import SequenceParallel

    seen = []
    sp = SequenceParallel(layout="zigzag")
    q = torch.randn(1, 20, 2, 4)
    for step in range(11):  # the offsets differ on rank 1 at step 10
        cu = torch.tensor([0, 6 if rank == 1 and step == 10 else 5, 40])
        try:
            plan = sp.plan_batch(20, cu)
            hla_sp.hla2(q, q, q, sp=sp, plan=plan)
        except ValueError as e:
            seen.append(f"step {step}: {e}")
    other = SequenceParallel(layout="contiguous")
    try:
        hla_sp.hla2(q, q, q, sp=other, plan=sp.plan_batch(20, None))
    except ValueError as e:
        seen.append(str(e))
    return seen


@pytest.mark.timeout(300)
def test_plan_batch_mismatch_raises_on_every_rank(world) -> None:
    outs = world(P).run(_mismatch_task, timeout=240)
    assert outs[0][0] == outs[1][0]  # the same text on every rank
    seen = outs[0]
    assert len(seen) == 2, seen
    assert seen[0].startswith("step 10: SequenceParallel.plan_batch: the ranks of the group "
                              "disagree on this batch: cu_seqlens differs across ranks: "
                              "2 documents (digest "), seen[0]
    assert "on ranks [0]" in seen[0] and "on ranks [1]" in seen[0]
    assert "plan: expected a plan of this SequenceParallel (layout 'contiguous'" in seen[1]


def test_batch_plan_is_frozen() -> None:
    plan = plan_documents(CU, T)
    assert isinstance(plan, BatchPlan)
    with pytest.raises(AttributeError):
        plan.T = 3  # type: ignore[misc]


def _short_shards_task(rank: int, world_size: int) -> int:
    """Three calls of each log_decay kind under check="auto" on shards of 0, 1 and 19
    tokens: the first call is fully checked, the later ones by their signature."""
    from hla_sp import SequenceParallel

    lengths = [0, 1, 19]
    sp = SequenceParallel(layout="contiguous")
    plan = sp.plan_batch(lengths[rank])
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, lengths[rank], 2, 4, generator=g)
    calls = 0
    for log_decay in (torch.tensor([-0.1, -0.2]), -torch.rand(1, lengths[rank], 2, generator=g)):
        for _ in range(3):
            hla_sp.hla2(q, q, q, log_decay=log_decay, sp=sp, plan=plan)
            calls += 1
    return calls


@pytest.mark.timeout(300)
def test_signature_agrees_on_shards_shorter_than_two_tokens(world) -> None:
    """A shard of fewer than 2 tokens cannot tell a per-head log_decay from a per-token
    one, so the signature hashes only that one is given: the later calls of an agreed
    call pass on every rank (they used to fail the signature on the short shards)."""
    assert world(3).run(_short_shards_task, timeout=240) == [6, 6, 6]

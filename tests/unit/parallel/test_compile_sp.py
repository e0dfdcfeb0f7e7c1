"""torch.compile(fullgraph=True) of HLA under sequence parallelism (gloo, CPU).

Under torch.compile the exchanges are functional collectives on the call's token chain
(:func:`hla_sp.parallel.exchange.traced_gather`) and the agreement check is the call's
signature alone. These tests check that the layer traces as one graph on every rank,
that its loss, every gradient and the final states equal eager mode's in fp64 (the
same operations; only the order of a few sums may differ, so 1e-12 relative), on 1 to 4
ranks with uneven and empty shards, packed documents and a carried state; that a rank
whose call differs raises on every rank; and that what cannot trace is refused by name.
"""

from __future__ import annotations

import pytest
import torch

from hla_sp.config import BUILTIN_OPERATORS
from hla_sp.testing import RemoteError

T, D = 32, 16


def _graph_counter(counter: dict[str, int]) -> object:
    """aot_eager, counting the graphs dynamo hands it (1: no graph break)."""
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        counter["graphs"] += 1
        return aot_eager(gm, example_inputs)

    return backend


def _flat_state(st: tuple) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for s in st:
        if isinstance(s, tuple):
            out += _flat_state(s)
        elif s is not None:
            out.append(s)
    return out


def layer_task(rank: int, P: int, op: str, layout: str, lengths: list[int] | None,
               packed: bool, carried: bool, decay: str = "data") -> dict:
    """Eager, then compiled: the loss, every parameter's gradient, the input's gradient
    and the final states of one sharded layer call, on this rank."""
    import os

    os.environ["HLA_SP_BACKEND"] = "torch"
    from hla_sp import SequenceParallel
    from hla_sp.nn import HLAttention
    from hla_sp.parallel import shard

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = HLAttention(D, 4, 4, num_kv_heads=2, operator=op, decay=decay, chunk_size=8).double()
    with torch.no_grad():  # zero at init: give the data gate and the first-order path values
        for p in (m.heads.decay_weight, m.heads.key_mix, m.heads.value_mix):
            if p is not None:
                torch.nn.init.normal_(p, std=0.5)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1 if packed else 2, T, D, dtype=torch.float64, generator=g)
    cu = torch.tensor([0, 9, 23, T]) if packed else None
    st0 = None
    if carried:  # a real state to continue from: one process over a prefix
        x0 = torch.randn(1 if packed else 2, 11, D, dtype=torch.float64, generator=g)
        with torch.no_grad():
            st0 = m(x0, cu_seqlens=torch.tensor([0, 4, 7, 11]) if packed else None,
                    output_final_state=True)[1]
    sp = SequenceParallel(layout=layout)
    kw = {} if lengths is None else {"lengths": lengths}
    xs = shard(x, rank, P, layout, **kw).requires_grad_(True)
    plan = sp.plan_batch(xs.shape[1], cu)  # built outside the compiled function

    def loss(xs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        y, st = m(xs, plan=plan, sp=sp, initial_state=st0, output_final_state=True)
        states = _flat_state(st)
        return y.square().sum() + sum(s.sum() for s in states), states

    def run(fn: object) -> list[torch.Tensor]:
        m.zero_grad(set_to_none=True)
        xs.grad = None
        value, states = fn(xs)  # type: ignore[operator]
        value.backward()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in m.parameters()]
        return [value.detach(), xs.grad.clone(), *(s.detach() for s in states),
                *(t.clone() for t in grads)]

    eager = run(loss)
    counter = {"graphs": 0}
    compiled = run(torch.compile(loss, fullgraph=True, backend=_graph_counter(counter)))
    return {"eager": eager, "compiled": compiled, "graphs": counter["graphs"]}


# (operator, layout, local lengths (None: even), packed documents, carried state). The
# 3- and 4-rank cases are marked slow (about a minute each on 2 cores: every rank
# compiles); `make test-slow` runs them.
_SLOW = pytest.mark.slow
CASES = [
    ("hla2", "zigzag", None, False, False),
    ("hla2", "zigzag", None, True, True),
    ("ahla", "contiguous", [T], True, True),
    pytest.param("hla2", "contiguous", [7, 0, 25], True, False, marks=_SLOW),  # empty shard
    pytest.param("linear", "contiguous", [10, 6, 9, 7], False, True, marks=_SLOW),
]
# Every other built-in operator of the table, with documents and a carried state.
CASES += [(op, "zigzag", None, True, True) for op in BUILTIN_OPERATORS
          if op not in {getattr(c, "values", c)[0] for c in CASES}]


def _case_id(c: object) -> str:
    op, layout, lengths, packed, carried = getattr(c, "values", c)
    return (f"{op}-{layout}-P{len(lengths) if lengths else 2}"
            f"{'-varlen' if packed else ''}{'-carried' if carried else ''}")


@pytest.mark.parametrize(("op", "layout", "lengths", "packed", "carried"), CASES,
                         ids=[_case_id(c) for c in CASES])
def test_compiled_layer_under_sp_equals_eager(world, op, layout, lengths, packed, carried):
    P = len(lengths) if lengths is not None else 2
    outs = world(P).run(layer_task, op, layout, lengths, packed, carried)
    for r, o in enumerate(outs):
        assert o["graphs"] == 1, (r, o["graphs"])  # fullgraph: one graph, no break
        assert len(o["eager"]) == len(o["compiled"])
        for i, (a, b) in enumerate(zip(o["compiled"], o["eager"])):
            atol = 1e-12 * float(b.abs().max()) if b.numel() else 0.0
            torch.testing.assert_close(a, b, rtol=1e-12, atol=atol,
                                       msg=lambda m, r=r, i=i: f"rank {r}, tensor {i}: {m}")


@pytest.mark.parametrize("decay", ["learned", "fixed", "none"])
def test_compiled_layer_under_sp_every_decay_kind(world, decay):
    """The layer's other decay kinds trace too: a per-head constant log_decay ("learned",
    the default, and "fixed") is broadcast over tokens, which the agreement check reads
    as a replicated value without leaving the graph."""
    outs = world(2).run(layer_task, "hla2", "zigzag", None, False, False, decay)
    for r, o in enumerate(outs):
        assert o["graphs"] == 1, (r, o["graphs"])
        for i, (a, b) in enumerate(zip(o["compiled"], o["eager"])):
            atol = 1e-12 * float(b.abs().max()) if b.numel() else 0.0
            torch.testing.assert_close(a, b, rtol=1e-12, atol=atol,
                                       msg=lambda m, r=r, i=i: f"rank {r}, tensor {i}: {m}")


def readme_task(rank: int, P: int) -> dict:
    """The README's example, ``hla2(q, k, v, log_decay=torch.full((H,), -0.01), sp=sp)``
    on a zigzag shard, eager and compiled with fullgraph."""
    import hla_sp
    from hla_sp import SequenceParallel

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(rank)
    B, Tl, H, K = 1, 16, 2, 8
    q, k, v = (torch.randn(B, Tl, H, K, generator=g, dtype=torch.float64) for _ in range(3))
    log_decay = torch.full((H,), -0.01, dtype=torch.float64)
    sp = SequenceParallel(layout="zigzag")

    def f(q, k, v):
        return hla_sp.hla2(q, k, v, log_decay=log_decay, sp=sp)[0]

    counter = {"graphs": 0}
    compiled = torch.compile(f, fullgraph=True, backend=_graph_counter(counter))(q, k, v)
    return {"eager": f(q, k, v), "compiled": compiled, "graphs": counter["graphs"]}


def test_readme_example_compiles_under_sp(world):
    for r, o in enumerate(world(2).run(readme_task)):
        assert o["graphs"] == 1, (r, o["graphs"])
        torch.testing.assert_close(o["compiled"], o["eager"], rtol=1e-12, atol=1e-12)


def mismatch_task(rank: int, P: int) -> None:
    """hla2 under sp, compiled, with rank 1's scale different: the signatures differ."""
    import hla_sp
    from hla_sp import SequenceParallel

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 8, 2, 4, generator=g, requires_grad=True) for _ in range(3))
    sp = SequenceParallel(layout="zigzag")
    scale = 0.5 if rank == 1 else 0.25

    def f(q, k, v):
        return hla_sp.hla2(q, k, v, sp=sp, scale=scale, chunk_size=4)[0].sum()

    torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v).backward()


def test_compiled_signature_mismatch_raises_on_every_rank(world):
    """A rank that calls with another option is caught on every rank by the signature
    that rides in the summaries' all-gather (no rank hangs)."""
    from hla_sp.parallel.summaries import SIGNATURE_MISMATCH

    with pytest.raises(RemoteError) as info:
        world(2).run(mismatch_task, timeout=240)
    assert sorted(info.value.errors) == [0, 1]
    for _, text in info.value.errors.values():
        assert SIGNATURE_MISMATCH in text


def refusal_task(rank: int, P: int, kw: dict, planned: bool) -> None:
    import hla_sp
    from hla_sp import SequenceParallel

    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 8, 2, 4, requires_grad=True) for _ in range(3))
    sp = SequenceParallel(**kw)
    plan = sp.plan_batch(8) if planned else None

    def f(q, k, v):
        return hla_sp.linear_attention(q, k, v, sp=sp, plan=plan, chunk_size=4)[0].sum()

    torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)


@pytest.mark.parametrize(("kw", "planned", "expected"), [
    ({"layout": "zigzag", "method": "ring"}, False, "method: torch.compile traces "
     "method='allgather' only"),
    ({"layout": "zigzag", "check": "always"}, False, "check: 'always' reads every rank's"),
    ({"layout": "contiguous"}, False, "plan: under torch.compile a contiguous layout "
     "needs the batch's plan"),
], ids=["ring", "check-always", "contiguous-without-plan"])
def test_compile_refuses_what_does_not_trace(world, kw, planned, expected):
    """Each is refused by name at trace time, before any collective, on every rank."""
    with pytest.raises(RemoteError) as info:
        world(2).run(refusal_task, kw, planned, timeout=240)
    assert sorted(info.value.errors) == [0, 1]
    for _, text in info.value.errors.values():
        assert expected in text, text[-2000:]

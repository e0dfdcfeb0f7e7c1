"""The exchange-method table is the only list of methods.

- ``hla_sp.parallel.exchange.EXCHANGES`` (name -> forward start, reverse start) has
  exactly the names of ``hla_sp.config.SPMethod``; the config's choices, the flags'
  choices, ``Plan``'s and ``SequenceParallel``'s checks derive from them;
- an unknown method raises a ValueError naming the argument, the choices and the value,
  in the forward exchange and in the reverse one;
- every method of the table round-trips exactly on 2 gloo ranks: its carries and the
  gradients of its reverse exchange equal the single-process fold (fp64, 1e-10), and so
  does an hla2 call with documents, decay and states under each method and layout.
"""

from __future__ import annotations

import argparse
import re
from typing import get_args

import pytest
import torch
from parallel_cases import case, run_cases

from hla_sp.config import SP_METHODS, HLAConfig, SPMethod
from hla_sp.parallel import METHODS, SequenceParallel, exchange
from hla_sp.parallel import summaries as S
from hla_sp.parallel.layouts import layout_pieces
from hla_sp.parallel.plan import Chain, Plan

NAMES = tuple(exchange.EXCHANGES)
UNKNOWN = "method: expected one of ('allgather', 'ring', 'tree'), got 'alltoall'"


def test_the_table_is_the_only_list() -> None:
    assert NAMES == SP_METHODS == get_args(SPMethod) == METHODS
    for name, entry in exchange.EXCHANGES.items():
        assert callable(entry.start) and callable(entry.reverse), name
        assert exchange.method_of(name) is entry
    parser = argparse.ArgumentParser()
    HLAConfig.add_flags(parser)
    action = next(a for a in parser._actions if a.dest == "hla_sp_method")
    assert tuple(action.choices) == NAMES
    for name in NAMES:  # every method is accepted where a method is configured
        assert HLAConfig(sp_method=name).sp_method == name
        assert SequenceParallel(method=name).method == name
        assert _plan(name).method == name
    with pytest.raises(TypeError):  # read-only: nothing registers a method elsewhere
        exchange.EXCHANGES["alltoall"] = exchange.EXCHANGES["ring"]  # type: ignore[index]


def _plan(method: str, lengths: tuple[int, ...] = (4,)) -> Plan:
    """A single-rank plan (no collective runs before the method is looked up)."""
    return Plan(rank=0, world_size=len(lengths), group=None, method=method, overlap=True,
                lengths=lengths, pieces=tuple(layout_pieces("contiguous", list(lengths))),
                T=sum(lengths), bounds=None, needs_grad=False,
                chain=Chain(torch.zeros(())))


def test_unknown_method_raises_in_both_directions() -> None:
    plan = _plan("ring")
    shape = S.SummaryShape(1, 1, 2, 2)
    X = torch.zeros(1, shape.size)
    with pytest.raises(ValueError, match=re.escape(UNKNOWN)):
        exchange.start("alltoall", plan, shape, X)
    with pytest.raises(ValueError, match=re.escape(UNKNOWN)):
        exchange.start_reverse("alltoall", plan, shape, X, X, None, X)
    with pytest.raises(ValueError, match=re.escape("got ['ring']")):
        exchange.method_of(["ring"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape(UNKNOWN)):
        _plan("alltoall")
    with pytest.raises(ValueError, match=re.escape(UNKNOWN)):
        SequenceParallel(method="alltoall")
    with pytest.raises(ValueError, match=re.escape(
            "sp_method: expected one of ('allgather', 'ring', 'tree'), got 'alltoall'")):
        HLAConfig(sp_method="alltoall")  # type: ignore[arg-type]


# ------------------------------------------------------------- exact on 2 gloo ranks


def _summaries(M: int, shape: S.SummaryShape, seed: int) -> torch.Tensor:
    """M packed fp64 summaries [M, D]: random states, log-decays <= 0, a document
    starting in piece 2 (its flag cuts the carry)."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(M, shape.n_state, generator=gen, dtype=torch.float64)
    a = -torch.rand(M, shape.B * shape.H, generator=gen, dtype=torch.float64)
    s = torch.zeros(M, 1, dtype=torch.float64)
    s[2 % M] = 1.0
    return torch.cat([h, a, s], dim=1)


def _round_trip_task(rank: int, P: int) -> list[str]:
    """Each method and layout: the carries of begin/scan and the gradient of the
    summaries (the reverse exchange) against the single-process fold's autograd."""
    from hla_sp.ops.validate import check_inputs

    shape = S.SummaryShape(1, 2, 3, 2)
    errors = []
    for layout, lengths in (("contiguous", (3, 5)), ("zigzag", (4, 4))):
        M = 2 * P if layout == "zigzag" else P
        X = _summaries(M, shape, seed=M)
        W = torch.randn(M, shape.size, generator=torch.Generator().manual_seed(1),
                        dtype=torch.float64)
        Xr = X.clone().requires_grad_(True)
        ref = S.exclusive_prefixes(shape, Xr, list(range(M)))
        (dX_ref,) = torch.autograd.grad((ref * W).sum(), Xr)
        q = torch.zeros(1, lengths[rank], 1, 1, dtype=torch.float64)
        for method in NAMES:
            sp = SequenceParallel(layout=layout, method=method)
            x = check_inputs(q, q, q, log_decay=None, scale=None, cu_seqlens=None, sp=sp,
                             chunk_size=8)
            plan = sp.check_call(x, op="exchange-table-test", options={})
            ms = [p.m for p in plan.own]
            mine = X[ms].clone().requires_grad_(True)
            ex, Xb = exchange.begin(plan, shape, mine, (None, None, None, None))
            carries = exchange.scan(plan, shape, ex, Xb)
            (carries * W[ms]).sum().backward()
            for what, got, want in (("carries", carries.detach(), ref.detach()),
                                    ("dX", mine.grad, dX_ref)):
                # Relative to all pieces' values: a rank's own may be all zero (the
                # first piece's carry, the last piece's gradient).
                err = float((got - want[ms]).abs().amax() / want.abs().amax())
                if not err < 1e-10:
                    errors.append(f"rank {rank} {layout}/{method} {what}: error {err:.3g}")
    return errors


@pytest.mark.timeout(300)
def test_every_method_round_trips_exactly(world) -> None:
    errors = world(2).run(_round_trip_task, timeout=240)
    assert errors == [[], []]


@pytest.mark.timeout(400)
def test_every_method_gives_the_single_process_hla2(world) -> None:
    cases = [case("hla2", T=16, method=method, layout=layout, decay="token",
                  cu=[0, 5, 11, 16], h0=True, final=True, lengths=None, seed=i)
             for i, (method, layout) in enumerate(
                 (m, lay) for m in NAMES for lay in ("contiguous", "zigzag"))]
    errors = world(2).run(run_cases, cases, timeout=360)
    assert errors == [[], []]

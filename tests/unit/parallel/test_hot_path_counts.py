"""Exact counts of collectives and host reads of one layer call in steady state.

On 2 gloo ranks (zigzag), an :class:`~hla_sp.nn.HLAttention` forward and backward is
run three times and the third call is counted (:func:`hla_sp.testing.counting`, which
wraps the torch.distributed functions and ``Tensor.item/tolist/cpu``): forward makes
the conv halo's all-gather and one exchange per composition stage (plus the final
states' all-reduces when asked for), backward their reverses, and neither reads a
tensor on the host, with packed documents too when they come as a batch plan (whose
construction reads the host once). Counts are deterministic, so they are compared
exactly.

Also here: the agreement design's two late-mismatch scenarios (module docs of
:mod:`hla_sp.parallel.engine`): a rank that changes an option, or its documents, at a
later call raises the same ValueError on every rank instead of hanging.
"""

from __future__ import annotations

import pytest
import torch

from hla_sp.parallel.layouts import layout_pieces
from hla_sp.testing import counting

STAGES = {"linear": 1, "hla2": 2, "ahla": 2, "hla3": 3}
P, T, HIDDEN, HEADS, HEAD_DIM = 2, 32, 32, 4, 8
DOCS = [0, 5, 19, T]  # global offsets: documents cross the ranks' pieces


def _p2p(method: str, rank: int, backward: bool) -> tuple[int, int]:
    """(sends, receives) of one exchange on ``rank`` (zigzag, P ranks): the ring hops
    between pieces of different owners, the tree's rounds join distance 2^d."""
    pieces = layout_pieces("zigzag", [T // P] * P)
    M, own = len(pieces), [p for p in pieces if p.owner == rank]
    sends = recvs = 0
    steps = [1] if method == "ring" else [1 << d for d in range((M - 1).bit_length())]
    for step in steps:
        for p in own:
            fwd_out = p.m + step < M and pieces[p.m + step].owner != rank
            fwd_in = p.m - step >= 0 and pieces[p.m - step].owner != rank
            sends += fwd_in if backward else fwd_out
            recvs += fwd_out if backward else fwd_in
    return sends, recvs


def expected(op: str, method: str, conv: bool, states: bool, rank: int) -> tuple[dict, dict]:
    """The collectives the math needs: forward, backward."""
    n = STAGES[op]
    finals = n + conv if states else 0  # one all-reduce per final state, both ways
    fwd = {"all_gather": int(conv) + (n if method == "allgather" else 0), "all_reduce": finals}
    bwd = {"reduce_scatter": n if method == "allgather" else 0,
           "all_reduce": int(conv) + finals}
    if method != "allgather":
        for d, backward in ((fwd, False), (bwd, True)):
            s, r = _p2p(method, rank, backward)
            d["send"], d["recv"] = n * s, n * r
    return ({k: v for k, v in fwd.items() if v}, {k: v for k, v in bwd.items() if v})


def _count_task(rank: int, world_size: int, cases: list[dict]) -> list[tuple[dict, dict]]:
    from hla_sp.nn import HLAttention
    from hla_sp.parallel import SequenceParallel, shard

    out = []
    for c in cases:
        torch.manual_seed(0)
        layer = HLAttention(HIDDEN, HEADS, HEAD_DIM, num_kv_heads=c["kv"], operator=c["op"],
                            short_conv=4 if c["conv"] else 0, decay=c.get("decay", "learned"))
        sp = SequenceParallel(layout="zigzag", method=c["method"])
        x = shard(torch.randn(1, T, HIDDEN), rank, world_size, "zigzag").requires_grad_()
        docs = {}
        if c.get("docs"):  # documents crossing ranks, planned once for the batch
            with counting() as build:
                docs = {"plan": sp.plan_batch(x.shape[1], torch.tensor(DOCS))}
            assert dict(build) == {"all_gather": 1, "tolist": 1}, build  # one host read
        n = len(DOCS) - 1 if docs else 1
        state = layer.init_state(n) if c["states"] else None
        for _ in range(3):
            with counting() as fwd:
                y, final = layer(x, sp=sp, initial_state=state,
                                 output_final_state=c["states"], **docs)
            loss = y.square().sum()
            if final is not None:
                loss = loss + sum(t.sum() for t in _leaves(final))
            with counting() as bwd:
                loss.backward()
        out.append((dict(fwd), dict(bwd)))
    return out


def _leaves(state: object) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    return [t for s in state for t in _leaves(s)] if state is not None else []


CASES = [
    dict(op="hla2", kv=4, conv=True, states=False, method="allgather"),  # the issue's
    dict(op="ahla", kv=2, conv=False, states=False, method="allgather"),
    dict(op="hla3", kv=4, conv=True, states=True, method="allgather"),
    dict(op="linear", kv=2, conv=True, states=True, method="allgather"),
    dict(op="hla2", kv=2, conv=True, states=True, method="allgather", decay="data"),
    dict(op="hla2", kv=4, conv=True, states=False, method="ring"),
    dict(op="linear", kv=2, conv=False, states=True, method="ring"),
    dict(op="hla3", kv=2, conv=True, states=False, method="tree"),
    dict(op="ahla", kv=4, conv=False, states=True, method="tree"),
    # documents through a batch plan: no host read either
    dict(op="hla2", kv=2, conv=True, states=True, method="allgather", docs=True),
    dict(op="hla3", kv=4, conv=False, states=False, method="ring", docs=True),
]


@pytest.mark.timeout(600)
def test_steady_state_counts(world) -> None:
    per_rank = world(P).run(_count_task, CASES, timeout=540)
    for rank, got in enumerate(per_rank):
        for c, (fwd, bwd) in zip(CASES, got):
            want = expected(c["op"], c["method"], c["conv"], c["states"], rank)
            assert (fwd, bwd) == want, (rank, c, fwd, bwd)


def _late_mismatch_task(rank: int, world_size: int) -> list[str]:
    """Calls agree, then one rank changes an option or its documents at a later call."""
    import hla_sp
    from hla_sp.nn import HLAttention
    from hla_sp.parallel import SequenceParallel, shard

    gen = torch.Generator().manual_seed(0)
    q, k, v = (shard(torch.randn(1, T, 2, 4, generator=gen), rank, world_size, "zigzag")
               for _ in range(3))
    seen = []

    def attempt(name, calls):
        try:
            for fn in calls:
                fn()
            seen.append(f"{name}: no error")
        except ValueError as e:
            seen.append(f"{name}: {e}")

    sp = SequenceParallel(layout="zigzag")
    late = [lambda i=i: hla_sp.hla2(q, k, v, sp=sp, output_final_state=rank == 1 and i == 3)
            for i in range(4)]
    attempt("option", late)
    cu = torch.tensor([0, 5, T])
    moved = torch.tensor([0, 6 if rank == 1 else 5, T])
    attempt("documents", [lambda i=i: hla_sp.linear_attention(
        q, k, v, cu_seqlens=moved if i == 3 else cu, sp=sp) for i in range(4)])
    torch.manual_seed(0)
    layer = HLAttention(8, 2, 4, short_conv=3)
    x = shard(torch.randn(1, T, 8, generator=gen), rank, world_size, "zigzag")
    attempt("layer", [lambda i=i: layer(x, sp=sp, output_final_state=rank == 0 and i == 2)
                      for i in range(3)])
    return seen


@pytest.mark.timeout(300)
def test_late_mismatch_raises_on_every_rank(world) -> None:
    """The signature rides in the first all-gather of the call: every rank sees the
    change and raises the full check's message (WorldTimeout on a hang)."""
    per_rank = world(P).run(_late_mismatch_task, timeout=240)
    expect = {
        "option": "output_final_state differs across ranks: False on ranks [0], True on ranks [1]",
        "documents": "cu_seqlens differs",
        "layer": "output_final_state differs across ranks: True on ranks [0], False on ranks [1]",
    }
    for seen in per_rank:
        assert len(seen) == len(expect), seen
        for line, (name, text) in zip(seen, expect.items()):
            assert line.startswith(f"{name}: ") and text in line, line
    assert per_rank[0] == per_rank[1]


def test_check_mode_is_validated() -> None:
    from hla_sp.parallel import SequenceParallel

    with pytest.raises(ValueError, match="check: expected one of"):
        SequenceParallel(check="sometimes")

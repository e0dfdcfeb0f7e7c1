"""The backward exchange overlaps the local backward.

In backward the scan starts the reverse exchange of the summaries' gradients (an
asynchronous reduce-scatter for allgather, a helper thread for ring and tree) and
returns; the backward of the stage's local outputs (the expensive chunk backward) runs
next, and only then does the exchange's first node wait for the reverse exchange.
The events are logged on every rank of a 2-rank gloo world and their order checked,
for each method; ``overlap=False`` keeps the wait before the local backward. Both
piece paths are checked: the torch path's split chunks (whose local backward here is
the part that needs only dO; the state terms follow the wait) and the composition of
zero-state outputs and the carry's term that the Triton kernels run.
"""

from __future__ import annotations

import pytest
import torch

import hla_sp
from hla_sp.config import SP_METHODS
from hla_sp.parallel import SequenceParallel


def _order_task(rank: int, P: int, method: str, overlap: bool, split: bool) -> list[str]:
    """One linear_attention fwd+bwd under sp; the order of start / local / wait events."""
    import hla_sp.ops.chunk_op as custom_op
    from hla_sp.ops.chunk_split import SplitChunks
    from hla_sp.parallel import exchange
    from hla_sp.parallel import primitive as prim

    events: list[str] = []
    real_bwd, real_begin_bwd = custom_op.chunk_backward, exchange._Begin.backward
    real_start, real_local = exchange.start_reverse, SplitChunks.local
    real_use_split = prim._use_split

    def chunk_backward(*a, **kw):
        events.append("local backward")
        return real_bwd(*a, **kw)

    def local(self, *a, **kw):
        events.append("local backward")
        return real_local(self, *a, **kw)

    def start_reverse(*a, **kw):
        out = real_start(*a, **kw)
        events.append("reverse exchange started")
        return out

    def begin_backward(ctx, *grads):
        events.append("reverse exchange waited")
        return real_begin_bwd(ctx, *grads)

    custom_op.chunk_backward = chunk_backward
    SplitChunks.local = local
    exchange.start_reverse = start_reverse
    exchange._Begin.backward = staticmethod(begin_backward)
    prim._use_split = lambda q: split
    try:
        torch.manual_seed(0)
        T = 64
        q, k, v = (torch.randn(1, T, 2, 8) for _ in range(3))
        s, e = rank * T // P, (rank + 1) * T // P
        q, k, v = (x[:, s:e].clone().requires_grad_() for x in (q, k, v))
        sp = SequenceParallel(method=method, overlap=overlap)
        o, _ = hla_sp.linear_attention(q, k, v, sp=sp, chunk_size=16)
        o.pow(2).sum().backward()
        assert q.grad is not None and torch.isfinite(q.grad).all()
    finally:
        custom_op.chunk_backward = real_bwd
        SplitChunks.local = real_local
        exchange.start_reverse = real_start
        exchange._Begin.backward = staticmethod(real_begin_bwd)
        prim._use_split = real_use_split
    return events


@pytest.mark.parametrize("split", [True, False], ids=["split", "composed"])
@pytest.mark.parametrize("method", SP_METHODS)
def test_reverse_exchange_in_flight_during_local_backward(world, method: str, split: bool) -> None:
    for events in world(2).run(_order_task, method, True, split, timeout=120):
        assert events == ["reverse exchange started", "local backward",
                          "reverse exchange waited"], events


@pytest.mark.parametrize("split", [True, False], ids=["split", "composed"])
def test_without_overlap_the_wait_comes_first(world, split: bool) -> None:
    for events in world(2).run(_order_task, "allgather", False, split, timeout=120):
        assert events == ["local backward", "reverse exchange started",
                          "reverse exchange waited"], events

"""The backward exchange overlaps the local backward.

In backward the scan starts the reverse exchange of the summaries' gradients (an
asynchronous reduce-scatter for allgather, a helper thread for ring and tree) and
returns; the backward of the stage's local outputs (the expensive chunk backward) runs
next, and only then does the exchange's first node wait for the reverse exchange.
The events are logged on every rank of a 2-rank gloo world and their order checked,
for each method; ``overlap=False`` keeps the wait before the local backward.
"""

from __future__ import annotations

import pytest
import torch

import hla_sp
from hla_sp.parallel import SequenceParallel


def _order_task(rank: int, P: int, method: str, overlap: bool) -> list[str]:
    """One linear_attention fwd+bwd under sp; the order of start / local / wait events."""
    import hla_sp.ops.custom_op as custom_op
    from hla_sp.parallel import exchange

    events: list[str] = []
    real_bwd, real_begin_bwd = custom_op.chunk_backward, exchange._Begin.backward
    real_scan_bwd = exchange._Scan.backward

    def chunk_backward(*a, **kw):
        events.append("local backward")
        return real_bwd(*a, **kw)

    def scan_backward(ctx, *grads):
        out = real_scan_bwd(ctx, *grads)
        events.append("reverse exchange started")
        return out

    def begin_backward(ctx, *grads):
        events.append("reverse exchange waited")
        return real_begin_bwd(ctx, *grads)

    custom_op.chunk_backward = chunk_backward
    exchange._Scan.backward = staticmethod(scan_backward)
    exchange._Begin.backward = staticmethod(begin_backward)
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
        exchange._Scan.backward = staticmethod(real_scan_bwd)
        exchange._Begin.backward = staticmethod(real_begin_bwd)
    return events


@pytest.mark.parametrize("method", ["allgather", "ring", "tree"])
def test_reverse_exchange_in_flight_during_local_backward(world, method: str) -> None:
    for events in world(2).run(_order_task, method, True, timeout=120):
        assert events == ["reverse exchange started", "local backward",
                          "reverse exchange waited"], events


def test_without_overlap_the_wait_comes_first(world) -> None:
    for events in world(2).run(_order_task, "allgather", False, timeout=120):
        assert events == ["local backward", "reverse exchange started",
                          "reverse exchange waited"], events

"""The chunk path split around a late carry-in state equals the chunk path.

``SplitChunks`` (the torch path of a shard under sequence parallelism) computes the
summary, the outputs with a carry-in state, d(carry-in) and the gradients in steps;
each is compared in fp64 to 1e-10 with the one-call chunk path: the outputs with the
state as h0, the summary as the final state from a zero state, and the gradients of
<o, W> + <summary, M> by autograd through both. Several blocks (partial last chunk
and block), document starts inside, on and across block edges, decay or none, with
or without a carry-in, and with either cotangent absent.
"""

from __future__ import annotations

import pytest
import torch
from op_table import rel_err

import hla_sp.ops.chunk.layout as layout
from hla_sp.ops.chunk_split import SplitChunks
from hla_sp.ops.primitive import make_chunk_impl

chunk_linear_attention = make_chunk_impl("torch")  # the operator the library calls

CASES = [
    # B, L, H, K, V, C, decay, document starts, carry-in
    (1, 100, 2, 8, 6, 16, True, None, True),
    (2, 64, 3, 4, 5, 16, True, None, False),
    (1, 130, 2, 8, 8, 32, False, [5, 70, 71], True),
    (1, 200, 2, 8, 8, 16, True, [3, 32, 40, 100], True),  # 32: a block edge
    (1, 5, 1, 4, 4, 16, True, None, True),
    (1, 260, 2, 4, 4, 64, True, [150], True),
]


@pytest.mark.parametrize("outputs, summary", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("case", CASES)
def test_split_equals_chunk_path(monkeypatch, case, outputs: bool, summary: bool) -> None:
    monkeypatch.setattr(layout, "BLOCK_TOKENS", 32)
    monkeypatch.setattr(layout, "BLOCK_WIDTH", 1)
    B, L, H, K, V, C, decay, starts, init = case
    gen = torch.Generator().manual_seed(L)
    dt = torch.float64

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dt)

    q, k, v = rnd(B, L, H, K), rnd(B, L, H, K), rnd(B, L, H, V)
    g = -torch.rand(B, L, H, generator=gen, dtype=dt) * 0.3 if decay else None
    resets = None
    if starts:
        resets = torch.zeros(B, L, dtype=torch.bool)
        resets[:, starts] = True
    h0 = rnd(B, H, K, V) if init else None
    W, M = rnd(B, L, H, V), rnd(B, H, K, V)

    leaves = [None if x is None else x.clone().requires_grad_() for x in (q, k, v, g, h0)]
    o, _ = chunk_linear_attention(*leaves[:4], resets=resets, h0=leaves[4], chunk_size=C)
    _, S = chunk_linear_attention(*leaves[:4], resets=resets, h0=None, chunk_size=C)
    ((o * W).sum() * outputs + (S * M).sum() * summary).backward()

    work = SplitChunks(q, k, v, g, resets, C)
    assert len(work.blocks) > 1 or L <= 32
    S_split = work.summary()
    work.intra()
    o_split = work.outputs(h0)
    assert rel_err(S_split, S) <= 1e-10
    assert rel_err(o_split, o) <= 1e-10
    if outputs:
        d_init = work.carry_grad(W)
        work.local(h0)
        if init:
            assert rel_err(d_init, leaves[4].grad) <= 1e-10
    grads = work.finish(M if summary else None)
    for name, got, leaf in zip(("dq", "dk", "dv", "dg"), grads, leaves[:4]):
        if leaf is None:
            assert got is None, name
            continue
        ref = torch.zeros_like(leaf) if leaf.grad is None else leaf.grad
        assert (got - ref).abs().max() <= 1e-10 * max(ref.abs().max().item(), 1.0), name

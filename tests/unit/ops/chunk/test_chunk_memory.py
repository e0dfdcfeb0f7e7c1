"""The torch chunk path is memory-lean: autograd keeps only the inputs, and the
blocked forward and backward give the same results whatever the block size.

Saved tensors are counted with ``torch.autograd.graph.saved_tensors_hooks``: every
tensor autograd keeps for the backward passes through the pack hook, so the count is
exactly what a training step holds between its forward and its backward.
"""

from __future__ import annotations

import pytest
import torch
from op_table import OPS_BY_NAME, make_inputs, rel_err

import hla_sp
import hla_sp.ops.chunk.layout as layout


def _saved_bytes(fn) -> tuple[int, torch.Tensor]:
    """Bytes of distinct storages autograd saves while running ``fn``."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


@pytest.mark.parametrize("name", ["linear_attention", "hla2"])
def test_autograd_keeps_only_inputs(name):
    """linear_attention keeps q (scaled), k, v, g (and the bad-token flags); hla2 adds
    its inner output k~ only.

    The previous chunk path kept every [B, H, N, C, C] score and decay matrix and the
    per-chunk states: 9x the inputs for linear_attention at this size.
    """
    B, T, H, K = 1, 1024, 2, 16
    q, k, v, g = (x.float().requires_grad_(True) for x in make_inputs(B, T, H, K, K))
    one = B * T * H * K * 4  # bytes of one [B, T, H, K] fp32 tensor
    fn = getattr(hla_sp, name)
    saved, (o, _) = _saved_bytes(lambda: fn(q, k, v, log_decay=g))
    # q * scale (1), k, v (2), g (1 / K), and for hla2 its inner output k~ (1); and per
    # primitive call the forward's bad-token flags, [B, T, H] bool (1 / 4K each).
    calls = 1 + (name == "hla2")
    allowed = one * (3 + (name == "hla2")) + B * T * H * 4 + calls * B * T * H
    assert saved <= allowed, (saved / one, allowed / one)
    o.sum().backward()  # and the backward runs from what was kept
    assert torch.isfinite(q.grad).all() and torch.isfinite(g.grad).all()


@pytest.mark.parametrize("block", [16, 32, 48, 4096])
@pytest.mark.parametrize("name", ["linear", "hla2"])
def test_block_size_only_changes_rounding(monkeypatch, name, block):
    """Several blocks (one chunk each, two, a partial last block), resets, h0 and
    final states: fp64 equal to the serial recurrence to 1e-10, gradients too."""
    monkeypatch.setattr(layout, "BLOCK_TOKENS", block)
    monkeypatch.setattr(layout, "BLOCK_WIDTH", 1)  # blocks of exactly ``block`` tokens
    op = OPS_BY_NAME[name]
    q, k, v, g = make_inputs(2, 75, 2, 8, 5, decay="token")
    init = [torch.randn(s, dtype=torch.float64) * 0.3 for s in op.state_shapes(2, 2, 8, 5)]
    init = [x @ x.mT if x.shape[-1] == x.shape[-2] == 8 else x for x in init]

    def grads(fn):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, g, *init)]
        o, st = fn(*xs[:4], xs[4:])
        gen = torch.Generator().manual_seed(5)
        loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
        loss = loss + sum((s * torch.randn(s.shape, generator=gen, dtype=s.dtype)).sum()
                          for s in st)
        return [o, *st, *torch.autograd.grad(loss, xs)]

    got = grads(lambda q, k, v, g, s: op.fast(q, k, v, g, s, True, 16))
    ref = grads(lambda q, k, v, g, s: op.recurrent(q, k, v, g, s))
    for i, (a, b) in enumerate(zip(got, ref)):
        assert rel_err(a, b) <= 1e-10, i


@pytest.mark.parametrize("block", [16, 32])
def test_block_size_with_documents(monkeypatch, block):
    """Packed documents whose starts fall inside and at the edges of blocks."""
    monkeypatch.setattr(layout, "BLOCK_TOKENS", block)
    monkeypatch.setattr(layout, "BLOCK_WIDTH", 1)  # blocks of exactly ``block`` tokens
    op = OPS_BY_NAME["hla2"]
    q, k, v, g = make_inputs(1, 75, 2, 8, 5, decay="token")
    cu = torch.tensor([0, 16, 23, 50, 75])
    o, st = hla_sp.hla2(q, k, v, log_decay=g, cu_seqlens=cu, output_final_state=True,
                        chunk_size=8)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_ref, st_ref = op.recurrent(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e])
        assert rel_err(o[:, s:e], o_ref) <= 1e-10
        assert rel_err(st[1][i : i + 1], st_ref[1]) <= 1e-10

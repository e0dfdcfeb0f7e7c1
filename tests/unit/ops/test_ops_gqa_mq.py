"""The multi-query chunk path: G query heads read one kv head's state, built once.

The primitive takes q [B, T, H G, K] against k, v [B, T, H, .] (query head h G + j
reads kv head h). It must equal the serial recurrence of every query head on its kv
head (repeated), outputs, final states and every gradient (dq, dk, dv, dg, dh0), with
packed documents, hard resets, initial states, a padded last chunk and several blocks.
fp64, to 1e-10 relative: the same sums in another order.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import hla_sp
from hla_sp.ops import primitive as prim
from hla_sp.ops import runner
from hla_sp.ops.chunk import layout
from hla_sp.ops.primitive import local_primitive
from hla_sp.ops.reference import recurrent_linear_attention

B, T, H, K, V, C = 1, 45, 2, 8, 6, 8  # T not a multiple of C: a padded last chunk
BOUNDS = (0, 13, 30, 45)


def _inputs(G: int, seed: int, decay: bool, h0: bool, n_seq: int) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H * G, K, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) / K**0.5
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.5 if decay else None
    s0 = torch.randn(n_seq, H, K, V, generator=gen, dtype=torch.float64) if h0 else None
    return [None if x is None else x.requires_grad_() for x in (q, k, v, g, s0)]


def _recurrence(q, k, v, g, h0, bounds, G):
    """Each query head's serial recurrence on its kv head, document by document:
    (o [B, T, H G, V], finals [N, H, K, V] at each group's first head)."""
    outs, finals = [], []
    for i, (s, e) in enumerate(itertools.pairwise(bounds)):
        rep = [x[:, s:e].repeat_interleave(G, dim=2) for x in (k, v)]
        gd = None if g is None else g[:, s:e].repeat_interleave(G, dim=2)
        init = None if h0 is None else h0[i : i + 1].repeat_interleave(G, dim=1)
        o, h = recurrent_linear_attention(q[:, s:e], *rep, log_decay=gd, scale=1.0,
                                          initial_state=init)
        outs.append(o)
        finals.append(h[:, ::G])
    return torch.cat(outs, 1), torch.cat(finals, 0)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, (what, a.shape, b.shape)
    a, b = a.detach(), b.detach()
    assert torch.isfinite(a).all(), what
    err = float((a - b).abs().max())
    assert err <= 1e-10 * max(float(b.abs().max()), 1.0), (what, err)


@pytest.mark.parametrize("G", [2, 4])
@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("decay,h0,blocks", [(True, True, False), (True, False, True),
                                             (False, True, True), (False, False, False)])
def test_multi_query_primitive_is_the_recurrence(
    G: int, docs: bool, decay: bool, h0: bool, blocks: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if blocks:  # blocks of 2 chunks: the carry between blocks, forward and backward
        monkeypatch.setattr(layout, "BLOCK_TOKENS", 1)
        assert len(layout.block_ranges(T, C, 1)) > 2
    bounds = BOUNDS if docs else (0, T)
    n = len(bounds) - 1
    q, k, v, g, s0 = _inputs(G, seed=G + 2 * docs, decay=decay, h0=h0, n_seq=n)
    if decay and docs:
        with torch.no_grad():
            g[0, 20, 1] = float("-inf")  # a hard reset inside a document, one kv head
    o, final = local_primitive(q, k, v, g, bounds=bounds if docs else None, h0=s0,
                               want_final=True, chunk_size=C)
    o_ref, final_ref = _recurrence(q, k, v, g, s0, bounds, G)
    _close(o, o_ref, "o")
    _close(final, final_ref, "final")
    gen = torch.Generator().manual_seed(7)
    wo = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    wf = torch.randn(final.shape, generator=gen, dtype=o.dtype)
    leaves = [x for x in (q, k, v, g, s0) if x is not None]
    grads = torch.autograd.grad((o * wo).sum() + (final * wf).sum(), leaves)
    refs = torch.autograd.grad((o_ref * wo).sum() + (final_ref * wf).sum(), leaves)
    for i, (a, b) in enumerate(zip(grads, refs)):
        _close(a, b, f"gradient of input {i}")


def test_grouped_operators_take_the_multi_query_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the torch backend the shared stages run no sub-tokens, and every operator still
    equals its call on repeated kv heads (documents included)."""

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the shared stage interleaved sub-tokens")

    monkeypatch.setattr(runner, "_interleave", refuse)
    G = 4
    q, k, v, g, _ = _inputs(G, seed=3, decay=True, h0=False, n_seq=1)
    cu = torch.tensor(BOUNDS)
    for op in ("hla2", "hla3", "ccq", "ahla", "linear_attention"):
        fn = getattr(hla_sp, op)
        o, _ = fn(q, k, v, log_decay=g, cu_seqlens=cu, chunk_size=C)
        rep = [x.repeat_interleave(G, dim=2) for x in (k, v, g)]
        o_ref, _ = fn(q, rep[0], rep[1], log_decay=rep[2], cu_seqlens=cu, chunk_size=C)
        _close(o, o_ref, op)


def test_multi_query_keeps_documents_apart() -> None:
    """A NaN in one document's k reaches no other document, outputs or gradients, and
    within its document all G query heads of the kv head (their state is one)."""
    G = 2
    q, k, v, g, _ = _inputs(G, seed=5, decay=True, h0=False, n_seq=1)
    with torch.no_grad():
        k[0, 15, 0, 3] = float("nan")  # document 1 (13..30), kv head 0
    o, _ = local_primitive(q, k, v, g, bounds=BOUNDS, chunk_size=C)
    assert torch.isnan(o[0, 15:30, :G]).all() and torch.isfinite(o[0, :15, :G]).all()
    assert torch.isfinite(o[0, 30:]).all() and torch.isfinite(o[0, :, G:]).all()
    o.nan_to_num(0.0).sum().backward()
    assert torch.isnan(q.grad[0, 13:30, :G]).all()
    assert torch.isfinite(q.grad[0, :13]).all() and torch.isfinite(q.grad[0, 30:]).all()
    assert torch.isfinite(k.grad[0, 30:]).all() and torch.isfinite(g.grad[0, :13]).all()


def test_multi_query_decode_step_continues_the_call() -> None:
    """One token with a carried state (the decode step, no autograd) continues the
    grouped call: o at the last token equals the whole call's."""
    G = 4
    q, k, v, g, _ = (None if x is None else x.detach()
                     for x in _inputs(G, seed=9, decay=True, h0=False, n_seq=1))
    o, _ = hla_sp.hla2(q, k, v, log_decay=g, chunk_size=C)
    _, st = hla_sp.hla2(q[:, :-1], k[:, :-1], v[:, :-1], log_decay=g[:, :-1],
                        output_final_state=True, chunk_size=C)
    with torch.no_grad():
        o1, _ = hla_sp.hla2(q[:, -1:], k[:, -1:], v[:, -1:], log_decay=g[:, -1:],
                            initial_state=st)
    _close(o1, o[:, -1:], "decode step")


def test_multi_query_refuses_heads_not_a_multiple() -> None:
    q, k, v, *_ = _inputs(2, seed=0, decay=False, h0=False, n_seq=1)
    with pytest.raises(ValueError, match="q: expected a multiple of k's 2 heads, got 3"):
        prim.chunk_linear_attention_op(q.detach()[:, :, :3], k.detach(), v.detach(), None,
                                       None, None, C, "torch")

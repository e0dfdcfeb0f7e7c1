"""The layer's defaults at long context: a small model's loss falls, nothing overflows.

Slow (a 64k-token sequence on CPU): ``pytest -m slow tests/unit/nn/test_nn_long.py -s``.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from hla_sp.nn import HLAttention

T_LONG = 65536


def train_tiny_lm(T: int, steps: int, seed: int = 0, **layer_kwargs) -> list[float]:
    """Adam steps of embedding -> HLAttention (residual) -> head on one fixed sequence.

    The sequence repeats a random block of 1024 tokens, so context helps; returns the
    loss of each step (NaN/inf are returned as they are, not hidden).
    """
    torch.manual_seed(seed)
    V, D = 64, 64
    emb = torch.nn.Embedding(V, D)
    att = HLAttention(D, 4, 16, 2, **layer_kwargs)
    head = torch.nn.Linear(D, V)
    params = [*emb.parameters(), *att.parameters(), *head.parameters()]
    opt = torch.optim.Adam(params, lr=3e-3)
    block = torch.randint(0, V, (1, 1024), generator=torch.Generator().manual_seed(seed))
    seq = block.repeat(1, T // 1024 + 1)[:, : T + 1]
    losses = []
    for _ in range(steps):
        h = emb(seq[:, :-1])
        y, _ = att(h)
        loss = torch.nn.functional.cross_entropy(head(h + y).reshape(-1, V), seq[0, 1:])
        opt.zero_grad()
        loss.backward()
        grads_ok = all(torch.isfinite(p.grad).all() for p in params if p.grad is not None)
        losses.append(loss.item() if grads_ok else float("nan"))
        opt.step()
    return losses


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_defaults_train_at_64k():
    t0 = time.time()
    losses = train_tiny_lm(T_LONG, steps=6)
    print(f"\n64k tokens, defaults: losses {[round(x, 4) for x in losses]} "
          f"({time.time() - t0:.0f} s)")
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0] - 0.05, losses

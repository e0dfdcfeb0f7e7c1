"""The rounding-error bound of ``hla_sp.testing`` holds for fp32 sums in any order and
at any thread count, and rejects an error a bug would make."""

from __future__ import annotations

import pytest
import torch

from hla_sp.testing import assert_within_rounding, decay_grad_magnitude, unit_roundoff


def test_unit_roundoff() -> None:
    assert unit_roundoff(torch.float32) == 2.0**-24
    assert unit_roundoff(torch.bfloat16) == 2.0**-8


def test_matmul_within_bound_at_any_thread_count(num_threads: int) -> None:
    """A long fp32 matmul (cancelling sums) meets n u |A||B|, whatever the blocking."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 4096, generator=gen, dtype=torch.float64)
    b = torch.randn(4096, 48, generator=gen, dtype=torch.float64)
    ref, mag = a @ b, a.abs() @ b.abs()
    got = a.float() @ b.float()
    # 4096 additions, one product, two input casts
    ratio = assert_within_rounding("a @ b", got, ref, mag, {torch.float32: 4096 + 3})
    assert ratio < 0.1  # the worst case is far from reached: the bound is not tight


def test_bug_sized_error_is_caught() -> None:
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(32, 256, generator=gen, dtype=torch.float64)
    b = torch.randn(256, 8, generator=gen, dtype=torch.float64)
    got = (a.float() @ b.float()).double()
    got[3, 4] += 1e-3 * (a.abs() @ b.abs())[3, 4]  # a wrong term, ~1e-3 relative
    with pytest.raises(AssertionError, match=r"a @ b: error .* at flat index 28 exceeds"):
        assert_within_rounding("a @ b", got, a @ b, a.abs() @ b.abs(), {torch.float32: 259})


def test_decay_grad_magnitude_shapes() -> None:
    loss = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # [B, H]
    per_token = decay_grad_magnitude(loss, (2, 5, 2), 5)
    assert per_token.shape == (2, 5, 2) and per_token[1, 3, 0] == 6.0
    per_head = decay_grad_magnitude(loss, (2,), 5, stages=2)
    assert per_head.tolist() == [5 * 4 * 4.0, 5 * 4 * 6.0]

"""The finiteness flags of document isolation are exact, however they are computed.

:func:`hla_sp.ops.isolation.bad_rows` reads each row's max and min instead of
``isfinite(x).all(-1)`` (one fifth of the time); it must flag exactly the rows that
hold a NaN, +inf or -inf, in every dtype, row length and memory layout, and never a
row of finite values, however large.
"""

from __future__ import annotations

import pytest
import torch

from hla_sp.ops.isolation import bad_rows, bad_state

NONFINITE = torch.tensor([float("nan"), float("inf"), float("-inf")])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [1, 3, 16, 17, 64, 128])
def test_bad_rows_is_isfinite_all(dtype: torch.dtype, D: int) -> None:
    gen = torch.Generator().manual_seed(D)
    x = torch.randn(2, 150, 3, D, generator=gen).to(dtype)
    n = 120
    at = tuple(torch.randint(0, s, (n,), generator=gen) for s in x.shape)
    x[at] = NONFINITE[torch.randint(0, 3, (n,), generator=gen)].to(dtype)
    x[0, 0, 0] = torch.finfo(dtype).max  # finite extremes are not flagged
    x[0, 0, 1] = -torch.finfo(dtype).max
    want = ~torch.isfinite(x).all(-1)
    assert want.any() and not want.all()
    assert torch.equal(bad_rows(x), want)
    xt = x.transpose(1, 2)  # a strided view
    assert torch.equal(bad_rows(xt), want.transpose(1, 2))


def test_bad_rows_edge_shapes() -> None:
    assert bad_rows(torch.zeros(2, 0, 3, 4)).shape == (2, 0, 3)
    empty_rows = bad_rows(torch.zeros(2, 5, 0))
    assert empty_rows.shape == (2, 5) and not empty_rows.any()
    h = torch.zeros(2, 3, 4, 5)
    h[1, 2, 3, 4] = float("-inf")
    want = torch.zeros(2, 3, dtype=torch.bool)
    want[1, 2] = True
    assert torch.equal(bad_state(h), want)
    assert bad_state(None) is None

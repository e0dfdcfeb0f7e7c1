"""The places where hla-sp departs from the paper, shown in numbers.

Run with ``-s`` to see the table each test prints. docs/math.md (section 6)
explains why we chose what we chose.
"""

from __future__ import annotations

import math

import pytest
import torch
from op_table import make_inputs, rel_err

import hla_sp
from hla_sp.ops import reference as R


@pytest.mark.parametrize("gamma", [0.99, 0.95, 0.8])
def test_decayed_second_order_paper_forms_disagree(gamma):
    """Sec. 4.3's online update and Sec. 4.2's monoid step differ from each other and
    from the decayed masked form; we define decay by the composition, whose serial
    recurrence and chunked scan agree to rounding."""
    q, k, v, _ = make_inputs(1, 32, 2, 8, 8)
    g = torch.full((2,), math.log(gamma), dtype=torch.float64)
    ours, _ = hla_sp.hla2(q, k, v, log_decay=g)
    recurrence, _ = R.recurrent_hla2(q, k, v, g)
    masked = R.naive_hla2(q, k, v, g)
    online = R.paper_hla2_masked_loop(q, k, v, gamma=gamma)
    monoid = R.paper_hla2_masked_loop(q, k, v, gamma=gamma, g_step_decay=True)
    errs = {
        "online vs masked": rel_err(online, masked),
        "monoid vs masked": rel_err(monoid, masked),
        "online vs monoid": rel_err(online, monoid),
        "ours vs masked": rel_err(ours, masked),
        "ours vs recurrence": rel_err(ours, recurrence),
    }
    print(f"\ngamma={gamma}: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    assert errs["ours vs masked"] < 1e-10 and errs["ours vs recurrence"] < 1e-10
    # The paper's two decayed forms are neither equal to each other nor to the
    # decayed masked product: the gaps are far above rounding (measured 3e-2 .. 3e-1).
    assert errs["online vs monoid"] > 1e-3
    assert errs["online vs masked"] > 1e-2
    assert errs["monoid vs masked"] > 1e-2


def test_second_order_forms_coincide_without_decay():
    q, k, v, _ = make_inputs(2, 40, 2, 8, 8)
    ours, _ = hla_sp.hla2(q, k, v)
    for form in (
        R.paper_hla2_masked_loop(q, k, v),
        R.paper_hla2_masked_loop(q, k, v, g_step_decay=True),
        R.naive_hla2(q, k, v),
    ):
        assert rel_err(ours, form) < 1e-10


def test_third_order_algorithm3_is_not_the_masked_product():
    """Algorithm 3 / (7.5) sums triples whose largest index repeats; the masked
    product keeps the middle index <= t. They differ by O(1) on random inputs."""
    q, k, v, _ = make_inputs(1, 10, 1, 4, 4)
    ours, _ = hla_sp.hla3(q, k, v)
    masked = R.naive_hla3(q, k, v)
    algo3 = R.paper_hla3_algorithm3(q, k, v)
    gap = rel_err(algo3, masked)
    print(f"\nhla3: ours vs masked {rel_err(ours, masked):.2e}, Algorithm 3 vs masked {gap:.2e}")
    assert rel_err(ours, masked) < 1e-10
    assert gap > 0.1


def test_third_order_brute_force_agrees_on_the_first_token():
    """A check of the brute-force reading itself: at t = 0 the only triple is
    (0, 0, 0), which both forms count; from t = 1 on, triples such as (1, 0, 1)
    (middle index below the others) enter Algorithm 3 but not the masked product."""
    q, k, v, _ = make_inputs(1, 6, 1, 4, 4)
    masked = R.naive_hla3(q, k, v)
    algo3 = R.paper_hla3_algorithm3(q, k, v)
    assert rel_err(algo3[:, :1], masked[:, :1]) < 1e-12
    assert rel_err(algo3[:, 2:], masked[:, 2:]) > 1e-3

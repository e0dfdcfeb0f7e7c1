"""The ahead-of-time gate (``benchmarks/aot.py``): every kernel configuration the public
API launches (every tuning candidate of the primitive's kernels) compiles for sm_90a
and sm_80, fits in shared memory, and spills at most 1 KiB per thread. No GPU is
needed: Triton compiles for a target without a driver, and the wheel's ``ptxas -v``
reports registers and spills. The opt-in sequential fused hla2's launcher refuses the
configurations measured over the same limit (``benchmarks/aot_sequential.py``, checked
current here).

The suite's matrix (:func:`aot.cases` with ``full=False``: every operator and dtype,
the default chunk, K = V = 32 and 128, per-token decay and every flag on) runs here;
``make gpu-aot`` runs the full one. Compiles run in parallel processes and are cached
by source hash under ``.aot-cache/`` (gitignored), so only the first run after a kernel
change pays for them (1.5 minutes on two cores).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import aot
import aot_sequential


def _row(**kw: object) -> dict:
    row = dict(kernel="k", arch="sm_90a", dtype="fp32", tiles={"BT": 64}, flags={},
               num_warps=4, num_stages=3, shared=1024, registers=128, spill_stores=0,
               spill_loads=0, error=None, default=True, used_by=["linear_attention/x"])
    row.update(kw)
    return row


def test_gate_refuses_what_it_should() -> None:
    """Each rule of the gate fires on a row that breaks it, and only then."""
    assert aot.failures([_row()], ["k"]) == []
    assert "never launched" in aot.failures([_row()], ["k", "other"])[0]
    assert "compile error" in aot.failures([_row(error="boom")], ["k"])[0]
    over = _row(arch="sm_80", shared=aot.SHARED_LIMIT["sm_80"] + 1)
    assert "shared memory" in aot.failures([over], ["k"])[0]
    assert aot.failures([_row(arch="sm_90a", shared=aot.SHARED_LIMIT["sm_80"] + 1)], ["k"]) == []
    assert aot.failures([_row(spill_loads=1024)], ["k"]) == []  # a small spill is allowed
    assert "spills" in aot.failures([_row(spill_loads=1025)], ["k"])[0]
    assert "spills" in aot.failures([_row(spill_stores=1025, default=False)], ["k"])[0]


# From a cold cache (a fresh clone, as CI has) the suite's matrix compiles in about 3
# minutes on two cores; `make gpu-aot` runs the full one, every tuning candidate (about
# 40 minutes cold on two shared cores).
@pytest.mark.timeout(1800)
def test_aot_gate() -> None:
    """Capture under the interpreter, compile for both archs, and pass the gate."""
    rows, bad, n_configs = aot.run(full=False)
    assert n_configs >= 30 and len(rows) == 2 * n_configs
    assert not bad, "\n".join(bad)


# Cold, each listed configuration compiles for both archs (BK = 128 takes 10-20 s a
# compile on two idle cores): over two minutes for the table, so marked slow.
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_sequential_table_is_current() -> None:
    """The sequential kernel's measured spills (what its launcher refuses from) are what
    the ahead-of-time compile of the current kernel gives."""
    from hla_sp.kernels.hla2_fused import SEQUENTIAL_MEASURED

    table, rows = aot_sequential.measure(set(SEQUENTIAL_MEASURED))
    assert len(rows) == 2 * len(SEQUENTIAL_MEASURED)
    assert table == SEQUENTIAL_MEASURED

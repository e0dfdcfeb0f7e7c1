"""The roofline model of the chunk_h / chunk_o design (benchmarks/roofline.py): hand
counts of its kernels, and its calibration against fla's published anchor."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import roofline as R


def test_state_pass_counts_by_hand() -> None:
    # B 1, T 128 (2 chunks), H 2, K = V = 64, [32, 32] state blocks: 4 programs a head
    k = R.state_pass("fwd_h", 1, 128, 2, 64, 64, 32, R.E)
    assert k.programs == 2 * 2 * 2
    assert k.flops == 2 * (2 * 128 * 64 * 64)
    per_head = 128 * 64 * 2 * 2 + 128 * 64 * 2 * 2 + 128 * 4 * 4 + 2 * 64 * 64 * 2
    assert k.nbytes == 2 * per_head


def test_occupancy_only_slows_grids_smaller_than_the_machine() -> None:
    small = R.Kernel("x", 64, 1e9, 1e9, 33)
    big = R.Kernel("x", 64, 1e9, 1e9, 10_000)
    roof, occ, limit = small.seconds(*R.GPUS["H200"])
    assert occ == pytest.approx(roof * R.SMS / 33) and "33 programs" in limit
    roof, occ, _ = big.seconds(*R.GPUS["H200"])
    assert occ == roof


def test_hla2_is_two_primitive_passes_and_the_anchor_is_near_fla() -> None:
    B, T, H, K = args = (1, 8192, 16, 128)
    la = R.primitive(*args, 128, "H200", False) + R.primitive(*args, 128, "H200", True)
    h2 = R.hla2(*args, "H200", False) + R.hla2(*args, "H200", True)
    # and the dq (bf16) and decay-gradient (fp32) sums: read two, write one, at 4.8 TB/s
    sums_ms = 1e3 * B * H * 3 * T * (K * R.E + R.F) / R.GPUS["H200"][1]
    assert R.total_ms(h2, "H200") == pytest.approx(2 * R.total_ms(la, "H200") + sums_ms)
    anchor = R.primitive(1, 8192, 96, 128, 128, "H100 SXM", False) \
        + R.primitive(1, 8192, 96, 128, 128, "H100 SXM", True)
    # fla's own kernels of this design reach the model within a few tens of percent
    assert 0.6 < R.total_ms(anchor, "H100 SXM") / R.FLA_ANCHOR_MS < 1.0

"""Smoke tests of the benchmark scripts: they run, and what they write is well formed.

Nothing here judges speed: timings on shared CI machines mean nothing, and the
performance targets are reported by ``benchmarks/bench_ops.py``, never asserted.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
OPS = ("hla2", "linear_attention", "sdpa", "recurrent_hla2")


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # One thread: on a loaded CI machine two OpenMP threads spin at barriers and
    # multiply the wall time; a smoke test only needs the code paths to run.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, f"{args} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench")
    _run([str(BENCH / "bench_ops.py"), "--quick", "--mem-jobs", "2", "--out", str(out)], out)
    return json.loads((out / "ops.json").read_text()), out


def test_bench_quick_writes_json_and_plot(quick_results: tuple[dict, Path]) -> None:
    res, out = quick_results
    assert (out / "ops.png").stat().st_size > 0
    for key in ("config", "machine", "Ts", "ops", "analysis", "matmul_gflops_reference"):
        assert key in res, key
    assert _finite(res["matmul_gflops_reference"]) and res["matmul_gflops_reference"] > 0
    assert set(res["ops"]) == set(OPS)


def test_bench_quick_points_are_finite_or_marked(quick_results: tuple[dict, Path]) -> None:
    res, _ = quick_results
    for op in OPS:
        for T in res["Ts"]:
            p = res["ops"][op][str(T)]
            if p["time_s"] == "not run":  # past the op's max T: marked, never extrapolated
                assert "reason" in p
                continue
            for key in ("time_s", "fwd_s", "flops", "gflops", "fraction_of_matmul"):
                assert _finite(p[key]) and p[key] > 0, (op, T, key, p[key])
            assert len(p["samples_s"]) == res["config"]["reps"]
            assert _finite(p["peak_extra_bytes"]), (op, T, p["peak_extra_bytes"])
    # hla2, linear_attention and SDPA run at every quick T; the recurrence at the first.
    for op in ("hla2", "linear_attention", "sdpa"):
        assert all(_finite(res["ops"][op][str(T)]["time_s"]) for T in res["Ts"])
    assert _finite(res["ops"]["recurrent_hla2"][str(res["Ts"][0])]["time_s"])


def test_bench_quick_analysis(quick_results: tuple[dict, Path]) -> None:
    a = quick_results[0]["analysis"]
    for key in ("time_exponent", "memory_exponent", "growth_16k_to_64k", "time_ratios",
                "targets"):
        assert key in a, key
    assert _finite(a["time_exponent"]["hla2"])
    for T, r in a["time_ratios"]["hla2/linear_attention"].items():
        assert _finite(r["ratio_of_medians"]) and _finite(r["median_paired_ratio"]), T
    # The quick set stops below 16k: targets that need 16k/64k say so instead of guessing.
    assert a["targets"]["speedup_vs_sdpa_16k"]["value"] == "not run"
    assert a["targets"]["hla2_growth_16k_to_64k"]["value"] == "not run"
    for t in a["targets"].values():
        assert set(t) == {"value", "target", "met"}


def test_ops_demo_passes(tmp_path: Path) -> None:
    r = _run([str(BENCH / "ops_demo.py"), "--ts", "256", "--reps", "1"], tmp_path)
    assert "all checks passed" in r.stdout
    for op in ("linear_attention", "hla2", "ahla", "hla3"):
        assert op in r.stdout


def test_bench_gqa_writes_ratios(tmp_path: Path) -> None:
    """bench_gqa.py times every group size of the heads and writes each ratio to G = 1."""
    _run([str(BENCH / "bench_gqa.py"), "--T", "64", "--K", "16", "--heads", "4", "--reps",
          "1", "--out", str(tmp_path), "--label", "_smoke"], tmp_path)
    res = json.loads((tmp_path / "gqa_T64_K16_smoke.json").read_text())
    assert set(res["ratio_to_G1"]) == {"1", "2", "4"}
    assert res["ratio_to_G1"]["1"] == 1.0
    assert all(math.isfinite(r) and r > 0 for r in res["ratio_to_G1"].values())


def test_bench_seeds_together_writes_both_ways(tmp_path: Path) -> None:
    """bench_seeds_together.py times a seed-step alone and together and writes the ratio."""
    _run([str(BENCH / "bench_seeds_together.py"), "--mixers", "linear", "--seeds", "2",
          "--steps", "2", "--out", str(tmp_path)], tmp_path)
    row = json.loads((tmp_path / "seeds_together.json").read_text())["mixers"]["linear"]
    assert all(_finite(row[k]) for k in ("ms_per_seed_step_alone",
                                         "ms_per_seed_step_together", "ratio"))
    assert row["ratio"] == pytest.approx(row["ms_per_seed_step_together"]
                                         / row["ms_per_seed_step_alone"])

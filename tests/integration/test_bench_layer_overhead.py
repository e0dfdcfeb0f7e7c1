"""benchmarks/bench_layer_overhead.py under torchrun, as `make gpu-check` runs it on GPUs:
the same rows as its own pool of gloo ranks, here with torchrun's two CPU ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_layer_overhead_runs_under_torchrun(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(ROOT / "benchmarks" / "bench_layer_overhead.py"), "--t-local", "32",
           "--layers", "2", "--reps", "2", "--d-model", "16", "--heads", "2",
           "--out", str(tmp_path), "--name", "lo"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads((tmp_path / "lo.json").read_text())
    (run,) = data["runs"]
    assert run["P"] == 2 and run["T_local"] == 32 and data["config"]["device"] == "cpu"
    assert all(t > 0 for t in run["min_s"].values())
    # the sharded path exchanges summaries; the single-rank path makes no collective
    assert run["counts_per_layer_call"]["sharded"].get("all_reduce", 0) > 0
    assert (tmp_path / "lo.png").exists()


def test_layer_overhead_refuses_cuda_without_torchrun(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_layer_overhead.py"),
                          "--device", "cuda", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode != 0 and "--device cuda: expected cpu without torchrun" in res.stderr

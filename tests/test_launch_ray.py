"""A 2-worker, 2-point Ray Train sweep on a local CPU cluster (no dashboard)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray.train")

HLA_SP = os.path.join(os.path.dirname(sys.executable), "hla-sp")


def test_ray_sweep_two_workers_two_lengths(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (tmp_path / "sweep.toml").write_text(
        f"""
world_sizes = [2]
seq_lengths = [64, 128]
train_iters = 2
output_dir = "{out}"
[ray]
num_cpus = 3
[trainer]
num_layers = 1
hidden_size = 32
num_attention_heads = 4
"""
    )
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [HLA_SP, "sweep", str(tmp_path / "sweep.toml")],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    rows = json.loads((out / "results.json").read_text())
    assert [(r["world_size"], r["cp"], r["seq_length"]) for r in rows] == [(2, 2, 64), (2, 2, 128)]
    for r in rows:
        assert r["status"] == "ok"
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0
        assert len(r["peak_mem_bytes_per_rank"]) == 2 and min(r["peak_mem_bytes_per_rank"]) > 0
        assert r["iters"] == 2 and r["loss_first"] > 0
    with open(out / "results.csv") as f:
        assert [int(row["seq_length"]) for row in csv.DictReader(f)] == [64, 128]
    for name in ("throughput_vs_p.png", "memory_vs_seq.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

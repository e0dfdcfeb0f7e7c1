"""benchmarks/bench_gpu.py runs end to end in its CPU dry run (tiny shapes, interpreter).

The GPU numbers come from benchmarks/gpu_check.sh on a GPU machine; this test keeps the
script itself working: its checks must pass and it must write every timing row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


# The GPU benchmark's dry run under the interpreter (about 45 s); the benchmark itself
# runs on the GPU machine in benchmarks/gpu_check.sh.
@pytest.mark.slow
def test_bench_gpu_dry_run(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        import pytest

        pytest.skip("on a GPU machine benchmarks/gpu_check.sh runs the real thing")
    out = tmp_path / "gpu_check.json"
    env = {k: v for k, v in os.environ.items() if k not in ("HLA_SP_BACKEND", "TRITON_INTERPRET")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--dry-run", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["dry_run"] is True
    checks = {(c["op"], c.get("dtype")) for c in result["check"] if c["ok"]}
    assert len(checks) == len(result["check"]) == 9, result["check"]
    methods = {"la", "hla2", "hla2_fused", "hla2_fused_seq"}
    assert {r["method"] for r in result["timings"]} >= methods
    assert all(r["error"] is None and r["ms"] > 0 for r in result["timings"])
    assert [r["path"] for r in result["paths"]["loss"]] == ["loss_plain", "loss_chunked"]
    assert [r["G"] for r in result["paths"]["gqa"]] == [1, 2, 4]


def test_bench_gpu_paths_run_on_cpu() -> None:
    """The loss and GQA comparisons that gpu-check adds, at toy sizes on the CPU."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_gpu_paths

    out = bench_gpu_paths.run("cpu", dry_run=True)
    assert [r["chunk"] for r in out["loss"]] == [None, 16]
    assert all(r["ms"] > 0 for rows in out.values() for r in rows)
    assert out["gqa"][0]["ratio_to_G1"] == 1.0 and [r["Hkv"] for r in out["gqa"]] == [4, 2, 1]

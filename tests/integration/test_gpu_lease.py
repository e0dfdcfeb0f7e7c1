"""benchmarks/gpu_lease.sh and its Python stages cannot rot: the dry run on CPU (tiny
shapes, the interpreter or the torch path) runs every stage's plumbing and the summary;
the kernel-name roles, the budget and the summary's verdicts are checked here too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def lease(out: Path, budget: int | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    env.pop("TRITON_INTERPRET", None)
    if budget is not None:
        env["BUDGET_S"] = str(budget)
    return subprocess.run(["bash", "benchmarks/gpu_lease.sh", "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.timeout(600)
def test_dry_run_runs_every_stage_and_writes_the_summary(tmp_path: Path) -> None:
    r = lease(tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["dry_run"] is True
    status = {x["stage"]: x["exit"] for x in s["stages"]}
    for name in ("peer", "kernels", "layer", "megatron_hla2_8k"):
        assert status[name] == "0", (name, (tmp_path / f"{name}.log").read_text()[-2000:])
    ms = {r["method"]: r["ms"] for r in s["peer"]["timings"]}
    for m in ("la", "la_g", "kernels_g", "hla2"):
        assert ms[m] is not None and ms[m] > 0, m
    assert ms["sdpa_flash"] is None  # no CUDA: absent, and said so
    from gpu_peer import TARGETS

    assert len(s["peer"]["targets"]) >= len(TARGETS) - 2  # the 8k/32k ones need those T
    assert all(t["ok"] is None for t in s["targets"])  # a dry run meets and misses nothing
    roles = {r["role"]: r["ours_calls"] for r in s["kernels"]["table"]}
    assert sum(roles.values()) >= 4 and "fwd_o" in roles and "bwd_dv" in roles
    mg = s["megatron"]["runs"]["hla2 8k"]
    assert mg["tokens_per_s"] == pytest.approx(22_567, rel=1e-3)  # the recorded H200 log
    assert 0 < mg["mfu"] < 0.05
    assert {r["layer"] for r in s["layer"]["rows"]} == {"hla2", "softmax"}
    md = (tmp_path / "summary.md").read_text()
    assert "DRY RUN" in md and "| target |" in md and md in r.stdout


def test_a_spent_budget_skips_stages_and_still_summarizes(tmp_path: Path) -> None:
    r = lease(tmp_path, budget=5)
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["stages"] and all(x["exit"] == "skipped" for x in s["stages"])
    assert s["peer"] is None and s["targets"] == []


@pytest.mark.parametrize("name, role", [
    ("chunk_fwd_kernel_h", "fwd_h"), ("chunk_bwd_kernel_dh", "bwd_dh"),
    ("chunk_fwd_kernel_o", "fwd_o"), ("chunk_bwd_kernel_dv", "bwd_dv"),
    ("chunk_bwd_kernel_dv_local", "bwd_dv"), ("chunk_bwd_kernel_dqkwg", "bwd_dqk"),
    ("chunk_local_cumsum_scalar_kernel", "cumsum"), ("chunk_state_kernel", "fwd_h"),
    ("state_passing_kernel", "fwd_h"), ("chunk_fwd_o_kernel", "fwd_o"),
    ("chunk_bwd_dqk_kernel", "bwd_dqk"), ("chunk_fwd_h_kernel", "fwd_h"),
    ("chunk_bwd_dh_kernel", "bwd_dh"), ("void at::native::elementwise_kernel<128, 4>", "other"),
])
def test_kernel_roles_by_name(name: str, role: str) -> None:
    from gpu_kernels import role as role_of

    assert role_of(name) == role


def test_summary_verdicts_from_the_stage_files(tmp_path: Path) -> None:
    from gpu_summary import summarize

    def mg(att: str, k: int, tps: float) -> None:
        (tmp_path / f"megatron_{att}_{k}k.json").write_text(json.dumps(dict(tokens_per_s=tps)))

    mg("hla2", 32, 30_000.0)
    mg("softmax", 32, 10_000.0)
    mg("hla2", 8, 20_000.0)  # no softmax at 8k: its ratio is n/a, and 8k has no target
    (tmp_path / "train_1m.jsonl").write_text("\n".join(json.dumps(x) for x in [
        {"event": "start"},
        {"iteration": 1, "seq_length": 1048576, "step_time_s": 9.0, "peak_mem_bytes": 2**36},
        {"iteration": 2, "seq_length": 1048576, "step_time_s": 2.0, "peak_mem_bytes": 2**36,
         "tokens_per_s": 524288.0}]))
    (tmp_path / "stages.tsv").write_text("peer\t124\t200\t200\n")
    s = summarize(tmp_path)
    assert s["stages"] == [dict(stage="peer", exit="124", seconds=200, limit=200)]
    (t,) = [t for t in s["targets"] if t["target"].startswith("Megatron")]
    assert t["value"] == pytest.approx(3.0) and t["ok"] is True and t["where"] == "32k"
    assert s["train_1m"]["step_time_s"] == 2.0 and s["train_1m"]["first_step_time_s"] == 9.0
    mg("hla2", 32, 12_000.0)
    (t,) = [t for t in summarize(tmp_path)["targets"] if t["target"].startswith("Megatron")]
    assert t["ok"] is False


def test_summary_puts_the_roofline_estimate_beside_each_role() -> None:
    from gpu_summary import estimates_us

    est = estimates_us("B1 T32768 H16 K128")
    assert set(est) == {"fwd_h", "fwd_o", "bwd_dh", "bwd_dv", "bwd_dqk"}
    import roofline

    fwd = {k.name: k.seconds(*roofline.GPUS["H200"])[1] * 1e6
           for k in roofline.primitive(1, 32768, 16, 128, 128, "H200", False)}
    assert est["fwd_o"] == pytest.approx(fwd["fwd_o"])
    assert est["fwd_h"] > fwd["fwd_h"]  # the backward's recompute is a fwd_h too
    assert estimates_us("B1 T32 H1 K16") == {}  # the dry run's shape: no estimate

"""hla-sp train's allocator policy for its workers (hla_sp.launch.distributed.allocator): glibc's
thresholds at 1 GiB unless the user chose the allocator, whose setting then reaches the
workers untouched; and the losses are bitwise those of the earlier policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hla_sp.launch.distributed.allocator import POLICY, set_worker_allocator

HLA_SP = os.path.join(os.path.dirname(sys.executable), "hla-sp")
# imported by --custom-import in the launcher and every worker: what each one runs with
PROBE = '''import json, os
with open(os.environ["PROBE_OUT"], "a") as f:
    f.write(json.dumps({"rank": os.environ.get("RANK"), **{k: v for k, v in os.environ.items()
                        if k.startswith("MALLOC_")}}) + "\\n")
'''
TINY = ["--nproc-per-node", "2", "--context-parallel-size", "2", "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "128",
        "--micro-batch-size", "2", "--train-iters", "4", "--lr", "3e-3", "--log-interval", "1",
        "--position-embedding-type", "none", "--seed", "3"]  # fmt: skip


@pytest.mark.parametrize(("env", "added"), [
    ({}, POLICY),
    ({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=1"}, POLICY),
    ({"MALLOC_MMAP_THRESHOLD_": "131072"}, {}),
    ({"MALLOC_ARENA_MAX": "2"}, {}),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, {}),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, {}),
])
def test_policy_unless_the_user_chose(env: dict[str, str], added: dict[str, str]) -> None:
    before = dict(env)
    assert set_worker_allocator(env) == added
    assert env == {**before, **added}


def _run(tmp: Path, name: str, user: dict[str, str]) -> tuple[list[float], list[dict]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(user, PYTHONPATH=str(tmp), PROBE_OUT=str(tmp / f"{name}.env"))
    p = subprocess.run([HLA_SP, "train", *TINY, "--custom-import", "probe_env",
                        "--log-jsonl", str(tmp / f"{name}.jsonl")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp / f"{name}.jsonl").read_text().splitlines()]
    seen = [json.loads(line) for line in (tmp / f"{name}.env").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], [s for s in seen if s["rank"] is not None]


def test_workers_get_the_policy_and_losses_stay_bitwise(tmp_path: Path) -> None:
    (tmp_path / "probe_env.py").write_text(PROBE)
    ours, ours_env = _run(tmp_path, "policy", {})
    theirs, theirs_env = _run(tmp_path, "user", {"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert sorted(e["rank"] for e in ours_env) == ["0", "1"]
    assert all({k: v for k, v in e.items() if k != "rank"} == POLICY for e in ours_env)
    assert all({k: v for k, v in e.items() if k != "rank"} == {"MALLOC_MMAP_THRESHOLD_": "131072"}
               for e in theirs_env), theirs_env
    # where tensors live changes, never what is computed: the same bits, every iteration
    assert len(ours) == 4 and ours == theirs, (ours, theirs)

"""Two torchrun "nodes" on this machine (c10d rendezvous, free port) equal one node of 4."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

from conftest import tiny_flags
from hla_sp.launch.distributed.local import (
    LocalRun,
    read_jsonl,
    run_local,
    torchrun_argv,
    worker_env,
)
from hla_sp.launch.distributed.process_groups import free_port

TINY = tiny_flags(1, 64, "--train-iters", "3", "--context-parallel-size", "4", "--seed", "11")


def run_nodes(
    flags: list[str],
    nnodes: int,
    nproc_per_node: int,
    jsonl: str,
    *,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> list[LocalRun]:
    """NNODES torchrun processes meeting at a c10d rendezvous on 127.0.0.1:<free port>.

    Every node gets the same flags; rank 0 (on whichever node the rendezvous puts it)
    writes the JSONL, which is attached to the first returned run.
    """
    if os.path.exists(jsonl):
        os.remove(jsonl)
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv = ["--nnodes", str(nnodes), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", uuid.uuid4().hex[:12]]  # fmt: skip
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            torchrun_argv(nproc_per_node, [*flags, "--log-jsonl", jsonl], rdzv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=worker_env(env),
        )
        for _ in range(nnodes)
    ]
    runs = []
    try:
        for p in procs:
            left = max(1.0, timeout - (time.perf_counter() - t0))
            out, _ = p.communicate(timeout=left)
            runs.append(LocalRun(p.returncode, out, time.perf_counter() - t0))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    runs[0].records = read_jsonl(jsonl)
    return runs


def test_two_nodes_with_cp_across_them_equal_one_node(tmp_path: Path) -> None:
    nodes = run_nodes(
        TINY, nnodes=2, nproc_per_node=2, jsonl=str(tmp_path / "n.jsonl"), timeout=300
    )
    for n in nodes:
        assert n.returncode == 0, n.output[-4000:]
    two = nodes[0].records
    # CP=4 over 2 x 2 processes: the CP group spans both nodes
    assert [r["world_size"] for r in two] == [4, 4, 4] and two[0]["cp"] == 4
    one = run_local(TINY, 4, str(tmp_path / "one.jsonl"), timeout=300)
    assert one.returncode == 0, one.output[-4000:]
    # same ranks, same groups, same gloo algorithms: the same numbers
    assert [r["loss"] for r in two] == one.losses

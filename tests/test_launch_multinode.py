"""Two torchrun "nodes" on this machine (c10d rendezvous, free port) equal one node of 4."""

from __future__ import annotations

from pathlib import Path

from hla_sp.launch.local import run_local, run_nodes

TINY = [
    "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "64", "--train-iters", "3", "--context-parallel-size", "4", "--seed", "11",
]  # fmt: skip


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

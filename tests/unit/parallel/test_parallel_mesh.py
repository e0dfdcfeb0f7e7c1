"""SequenceParallel over a DeviceMesh: a 2 x 2 (dp x cp) mesh on 4 gloo ranks.

Each data-parallel replica has its own batch; its two context-parallel ranks hold the
zigzag halves of the sequence. Outputs and gradients must equal the single-process
result of that replica's batch; with FSDP2 sharding the layer over the flattened
dp x cp mesh (torchtitan's layout), the full gradients must equal the mean of the
replicas' single-process gradients. docs/parallel.md shows the same code.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import hla_sp
from hla_sp import SequenceParallel
from hla_sp.parallel import shard
from hla_sp.testing import World

T, H, K = 64, 2, 8


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))


def _ops_on_mesh(rank: int, world_size: int) -> dict[str, float]:
    mesh = _mesh()
    dp, cp = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")
    sp = SequenceParallel(mesh, mesh_dim="cp", layout="zigzag")
    # the 1-D submesh names the same group; so does its process group
    same = SequenceParallel(mesh["cp"], layout="zigzag")
    groups = [dist.get_process_group_ranks(s.group) for s in (sp, same)]
    assert groups[0] == groups[1] and len(groups[0]) == 2 and (sp.rank, sp.world_size) == (cp, 2)
    assert rank in groups[0]
    gen = torch.Generator().manual_seed(100 + dp)  # each replica its own batch
    q, k = (torch.randn(1, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, T, H, K, generator=gen, dtype=torch.float64)
    w = torch.randn(1, T, H, K, generator=gen, dtype=torch.float64)
    g = torch.full((H,), -0.05, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    o_ref, _ = hla_sp.hla2(*full, log_decay=g)
    (o_ref * w).sum().backward()
    local = [shard(t, cp, 2, "zigzag").detach().requires_grad_() for t in (q, k, v)]
    o, _ = hla_sp.hla2(*local, log_decay=g, sp=sp)
    (o * shard(w, cp, 2, "zigzag")).sum().backward()
    err = {"o": (o - shard(o_ref, cp, 2, "zigzag")).abs().max().item()}
    for name, a, b in zip(("dq", "dk", "dv"), local, full):
        err[name] = (a.grad - shard(b.grad, cp, 2, "zigzag")).abs().max().item()
    return err


def _fsdp2_on_mesh(rank: int, world_size: int) -> float:
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh()
    dp, cp = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")
    sp = SequenceParallel(mesh, mesh_dim="cp", layout="zigzag")
    torch.manual_seed(0)
    from hla_sp.nn import HLAttention

    model = HLAttention(32, 4, chunk_size=16, dtype=torch.float64)
    ref = copy.deepcopy(model)
    # torchtitan shards parameters over dp x cp (its "dp_shard_cp" mesh): every rank
    # holds a slice, and the gradient reduction averages over all four ranks
    fully_shard(model, mesh=mesh["dp", "cp"]._flatten("dp_cp"))
    xs = [torch.randn(1, T, 32, generator=torch.Generator().manual_seed(200 + d),
                      dtype=torch.float64) for d in range(2)]
    y, _ = model(shard(xs[dp], cp, 2, "zigzag"), sp=sp)
    # the mean over this rank's tokens; equal shards make FSDP's mean over the cp ranks
    # the replica's mean, and its mean over dp the mean of the replicas
    (y**2).mean().backward()
    for x in xs:  # the reference: the mean of the replicas' single-process losses
        y_ref, _ = ref(x)
        ((y_ref**2).mean() / len(xs)).backward()
    worst = 0.0
    for (name, p), (_, p_ref) in zip(model.named_parameters(), ref.named_parameters()):
        got = p.grad.full_tensor()
        scale = p_ref.grad.abs().max().item() + 1e-30
        worst = max(worst, (got - p_ref.grad).abs().max().item() / scale)
        assert got.shape == p_ref.grad.shape, name
    return worst


@pytest.fixture(scope="module")
def world() -> World:
    with World(4) as w:
        yield w


def test_sequence_parallel_takes_a_2x2_mesh_by_its_cp_dimension(world: World) -> None:
    for err in world.run(_ops_on_mesh):
        assert max(err.values()) < 1e-12, err  # fp64: rounding only


def test_fsdp2_over_the_flattened_mesh_equals_the_replicas_mean(world: World) -> None:
    pytest.importorskip("torch.distributed.fsdp")
    for rel in world.run(_fsdp2_on_mesh):
        assert rel < 1e-10, rel


def test_mesh_dim_is_required_and_checked() -> None:
    """No process group needed: the mesh is checked before its group is read."""
    pytest.importorskip("torch.distributed.device_mesh")
    with pytest.raises(ValueError, match="mesh_dim: only meaningful"):
        SequenceParallel(None, mesh_dim="cp")

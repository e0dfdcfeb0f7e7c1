"""Which process group a ``SequenceParallel`` runs over: a group, a DeviceMesh's
dimension or WORLD, resolved once and checked to hold this process."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def resolve_group(group: object, mesh_dim: str | int | None) -> dist.ProcessGroup | None:
    """The process group of ``group`` (a ProcessGroup, a DeviceMesh through ``mesh_dim``,
    or None for WORLD), or a ValueError/TypeError naming ``group`` or ``mesh_dim``."""
    if _is_device_mesh(group):
        group = _mesh_group(group, mesh_dim)  # type: ignore[arg-type]
    elif mesh_dim is not None:
        raise ValueError("mesh_dim: only meaningful when group is a DeviceMesh")
    if _non_member(group):
        rank = dist.get_rank() if dist.is_initialized() else "?"
        raise ValueError(
            "SequenceParallel: group: expected a process group this process belongs to, "
            "got torch.distributed.GroupMember.NON_GROUP_MEMBER, which new_group returns "
            f"to the ranks it leaves out: this process (global rank {rank}) is not in "
            "the group; build SequenceParallel on the group's ranks only"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group: expected a torch.distributed.ProcessGroup, a DeviceMesh or None, "
            f"got {type(group).__name__}"
        )
    return group


def member_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``group`` (WORLD for None) once torch.distributed is up, checked to hold this
    process."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "SequenceParallel: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group first"
        )
    group = group if group is not None else dist.group.WORLD
    if dist.get_rank(group) < 0:  # torch returns -1 (with a warning) for a non-member
        try:
            members = dist.get_process_group_ranks(group)
        except (RuntimeError, ValueError):  # the rank knows nothing of the group
            members = "unknown"
        raise ValueError(
            f"SequenceParallel: group: expected a process group this process belongs "
            f"to (ranks {members}), got one without this process (global rank "
            f"{dist.get_rank()})"
        )
    return group


def _is_device_mesh(x: object) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # a torch without DeviceMesh: nothing can be one
        return False
    return isinstance(x, DeviceMesh)


def _non_member(group: object) -> bool:
    """True for the marker torch.distributed gives a rank outside a new group (an int)."""
    marker = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", None)
    return (marker is not None and isinstance(group, int) and not isinstance(group, bool)
            and group == marker)


def _mesh_group(mesh: DeviceMesh, dim: str | int | None) -> dist.ProcessGroup:
    """The process group of one dimension of ``mesh`` (its only one when 1-D)."""
    names = mesh.mesh_dim_names or ()
    if dim is None:
        if mesh.ndim != 1:
            raise ValueError(
                f"mesh_dim: a {mesh.ndim}-D DeviceMesh (dimensions {names or mesh.ndim}) needs "
                f"the context-parallel dimension, e.g. mesh_dim='cp', or pass mesh['cp']"
            )
        return mesh.get_group()
    if isinstance(dim, str) and dim not in names:
        raise ValueError(f"mesh_dim: {dim!r} is not a dimension of the mesh; it has {names}")
    if isinstance(dim, int) and not 0 <= dim < mesh.ndim:
        raise ValueError(f"mesh_dim: expected 0 <= mesh_dim < {mesh.ndim}, got {dim}")
    return mesh.get_group(dim)

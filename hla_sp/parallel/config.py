"""``SequenceParallel``: the validated description of how a sequence is sharded.

Each public call checks, once and with one small all-gather, that every rank of the
group agrees on the call (shapes, dtype, layout, method, operator, scale, whether
log_decay is given and its kind (per token, or a per-head constant and a digest of its
values), each named option (an initial state: whether it is given and a digest of its
values), document boundaries) before any summary is exchanged. A mismatch raises the
same ValueError on every rank, naming what differs, its value on each rank and on
which ranks, instead of hanging in a later collective or silently computing with one
rank's values (the rows, digests and messages are in :mod:`hla_sp.parallel.agreement`).
:meth:`SequenceParallel.check_call` returns the call's
:class:`~hla_sp.parallel.plan.Plan`, which the caller hands to every primitive stage
of the call: ``SequenceParallel`` itself is configuration. It implements the protocol
:class:`hla_sp.ops.sharding.SequenceParallelism` that the operators call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hla_sp.ops.validate import Inputs

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
from hla_sp.parallel.agreement import disagreements, gather_rows, metadata_row, named_options
from hla_sp.parallel.layouts import LAYOUTS, layout_pieces
from hla_sp.parallel.plan import METHODS, Chain, Plan
from hla_sp.parallel.primitive import sp_primitive

__all__ = ["METHODS", "SequenceParallel"]


@dataclass
class SequenceParallel:
    """Sequence parallelism over a process group, passed as ``sp=`` to every operator.

    Each rank passes its local shard [B, T_local, H, *]; ``cu_seqlens`` and
    ``initial_state`` are global and the same on every rank, and so must be
    ``output_final_state`` (it decides whether the final states are all-reduced).

    Gradients follow "the global loss is the sum of the ranks' losses": a replicated
    input (``initial_state``, a per-head ``log_decay``) gets on each rank the part of
    its gradient that flows from that rank, and the sum over ranks (what a gradient
    all-reduce computes) is the single-process gradient; a replicated output (the
    final state) passes back the sum of every rank's gradient of it. Under grad mode
    every call builds its backward collectives, so every rank must call backward.
    """

    group: dist.ProcessGroup | DeviceMesh | None = None
    """The process group; None for the default (WORLD) group. A ``DeviceMesh``
    (torchtitan, FSDP2) is taken too: a 1-D mesh (``mesh["cp"]``) as it is, a larger
    one through its dimension ``mesh_dim``; the group is resolved once, here."""
    layout: str = "contiguous"
    """"contiguous": rank r holds the r-th piece (any lengths, may be empty);
    "zigzag": 2P equal chunks, rank r holds chunks r and 2P-1-r."""
    method: str = "allgather"
    """Exchange of summaries: "allgather" (one collective), "ring" (P-1 hops) or
    "tree" (ceil(log2 M) rounds of point-to-point messages, M pieces)."""
    check_timeout_s: float | None = 600.0
    """How long the per-call agreement check waits for every rank to join it before
    raising (a rank that failed its own argument checks never joins); None waits as
    long as the process group's own timeout. 600 s is NCCL's default timeout."""
    overlap: bool = True
    """Compute the local outputs while the summaries are exchanged. False waits for the
    exchange first: benchmarks use it to measure how much of the exchange the overlap
    hides. Results are the same either way."""
    mesh_dim: str | int | None = None
    """With a ``DeviceMesh`` of more than one dimension as ``group``: the name (or
    index) of its context-parallel dimension, e.g. ``"cp"``."""

    def __post_init__(self) -> None:
        if _is_device_mesh(self.group):
            self.group = _mesh_group(self.group, self.mesh_dim)
        elif self.mesh_dim is not None:
            raise ValueError("mesh_dim: only meaningful when group is a DeviceMesh")
        if _non_member(self.group):
            rank = dist.get_rank() if dist.is_initialized() else "?"
            raise ValueError(
                "SequenceParallel: group: expected a process group this process belongs to, "
                "got torch.distributed.GroupMember.NON_GROUP_MEMBER, which new_group returns "
                f"to the ranks it leaves out: this process (global rank {rank}) is not in "
                "the group; build SequenceParallel on the group's ranks only"
            )
        if self.group is not None and not isinstance(self.group, dist.ProcessGroup):
            raise TypeError(
                f"group: expected a torch.distributed.ProcessGroup, a DeviceMesh or None, "
                f"got {type(self.group).__name__}"
            )
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {self.layout!r}")
        if self.method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {self.method!r}")
        if not isinstance(self.overlap, bool):
            raise TypeError(f"overlap: expected a bool, got {type(self.overlap).__name__}")
        t = self.check_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0):
            raise ValueError(f"check_timeout_s: expected a number > 0 or None, got {t!r}")

    def _group(self) -> dist.ProcessGroup:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "SequenceParallel: torch.distributed is not initialized; call "
                "torch.distributed.init_process_group first"
            )
        group = self.group if self.group is not None else dist.group.WORLD
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

    @property
    def rank(self) -> int:
        return dist.get_rank(self._group())

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self._group())

    def check_call(
        self,
        inputs: Inputs,
        *,
        op: str,
        options: Mapping[str, object] | Sequence[tuple[str, object]],
    ) -> Plan:
        """Check that every rank agrees on this call; raise the same error everywhere.

        ``options`` names every option that must agree: a mapping name -> value, or
        (name, value) pairs. A value is None, a bool, int, float or str (compared
        exactly), or a tensor or tuple of tensors such as an initial state (compared by
        whether one is given and a digest of its values). Scale and log_decay come from
        ``inputs``. One all-gather of a small int64 row per rank. Returns the call's
        :class:`Plan`, which every primitive stage of the call takes (``plan=``).
        """
        group = self._group()
        rank, P = dist.get_rank(group), dist.get_world_size(group)
        cu = inputs.cu_seqlens
        bounds = None if cu is None else tuple(int(c) for c in cu.tolist())
        named = named_options(options)
        row = metadata_row(inputs, op, named, bounds, layout=self.layout, method=self.method)
        table = gather_rows(row, group, P, op, self.check_timeout_s)
        lengths = tuple(r[-1] for r in table)
        names = [n for n, _ in named]
        problems = disagreements(table, names) or self._call_problems(lengths, bounds)
        if problems:
            # The same text on every rank: it is built from the gathered table only.
            raise ValueError(
                "SequenceParallel: the ranks of the group disagree on this call: "
                + "; ".join(problems)
            )
        needs_grad = torch.is_grad_enabled()
        token = torch.zeros((), dtype=torch.float32, requires_grad=needs_grad)
        plan = Plan(
            rank=rank, world_size=P, group=group, method=self.method, overlap=self.overlap,
            lengths=lengths, pieces=tuple(layout_pieces(self.layout, list(lengths))),
            T=sum(lengths), bounds=bounds, needs_grad=needs_grad, chain=Chain(token),
        )
        return plan

    def _call_problems(
        self, lengths: tuple[int, ...], bounds: tuple[int, ...] | None
    ) -> list[str]:
        """What is wrong with a call the ranks agree on (same text on every rank)."""
        problems = []
        P, total = len(lengths), sum(lengths)
        if bounds is not None and bounds[-1] != total:
            problems.append(
                f"cu_seqlens[-1] = {bounds[-1]} but the local lengths {list(lengths)} "
                f"(ranks 0..{P - 1}) sum to {total}"
            )
        if total == 0:
            problems.append("every rank's shard is empty (global T = 0)")
        if self.layout == "zigzag" and (len(set(lengths)) != 1 or lengths[0] % 2):
            problems.append(
                f"zigzag layout needs the same even local T on every rank, got {list(lengths)}"
            )
        return problems

    def primitive(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor | None,
        *,
        cu_seqlens: torch.Tensor | None,
        h0: torch.Tensor | None,
        want_final: bool,
        chunk_size: int,
        plan: Plan | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The primitive over this rank's shard under ``plan``, the :class:`Plan` that
        :meth:`check_call` returned for the call (see
        :func:`hla_sp.parallel.primitive.sp_primitive`)."""
        if plan is None:
            raise RuntimeError(
                "SequenceParallel: no checked call matches this shard (local T = "
                f"{q.shape[1]}): the primitive's stages take the plan that "
                "sp.check_call(...) returned for their call (plan=...)"
            )
        # A cheap guard (the offsets were converted once, by check_call): a plan of
        # another call would fold the wrong pieces.
        if plan.lengths[plan.rank] != q.shape[1] or (plan.bounds is None) != (cu_seqlens is None):
            raise RuntimeError(
                f"SequenceParallel: no checked call matches this shard (local T = "
                f"{q.shape[1]}): the plan was made for local T = {plan.lengths[plan.rank]}"
                f" and {'no' if plan.bounds is None else ''} cu_seqlens"
            )
        return sp_primitive(
            q, k, v, g, h0=h0, want_final=want_final, chunk_size=chunk_size, plan=plan
        )


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

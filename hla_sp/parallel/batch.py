"""A plan per batch under sequence parallelism: :meth:`SequenceParallel.plan_batch`.

A training step builds one :class:`~hla_sp.ops.sharding.BatchPlan` per (micro-)batch
and passes it as ``plan=`` to every layer: the document offsets, every rank's local
length and the layout's pieces are then Python ints, computed once, and no layer or
stage reads a tensor on the host for them.

Building it costs at most one all-gather of a 3-word row per rank (local T, number of
offsets, an on-device digest of the offsets) and one host transfer (that table and
the offsets, read together). The all-gather is what makes the plan agreed: a rank
whose ``cu_seqlens`` differs raises the same ValueError on every rank, naming
cu_seqlens, when the plan is built, and a contiguous layout learns the other ranks'
lengths there instead of at every call. It is skipped only where nothing needs it
(one rank; a zigzag layout, whose lengths follow from this rank's, with
``check="never"``). The plan's digest of the offsets (a Python int, hashed once) is
what every call's agreement signature carries instead of hashing the offsets again.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hla_sp.ops.sharding import BatchPlan, bounds_digest, check_bounds, documents_bounds
from hla_sp.parallel.agreement import gather_words
from hla_sp.parallel.digests import tensor_digest
from hla_sp.parallel.layouts import call_problems, layout_pieces


def _row_device(group: dist.ProcessGroup, cu: torch.Tensor | None) -> torch.device:
    """Where the all-gathered row lives: the device the group's backend reaches."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return cu.device if cu is not None and "nccl" not in backend else torch.device("cpu")


def plan_batch(group: dist.ProcessGroup, layout: str, T_local: int,
               cu_seqlens: torch.Tensor | None = None, *, gather: bool = True,
               timeout_s: float | None = None) -> BatchPlan:
    """The batch's plan on this rank of ``group`` under ``layout`` (see
    :meth:`SequenceParallel.plan_batch`). ``gather``: compare the ranks' offsets and learn
    their lengths by one all-gather (False only where the lengths follow from this
    rank's: the zigzag layout, with the check off); ``timeout_s``: how long it waits."""
    rank, P = dist.get_rank(group), dist.get_world_size(group)
    if isinstance(T_local, bool) or not isinstance(T_local, int) or T_local < 0:
        raise ValueError(f"T_local: expected an int >= 0 (this rank's tokens), got {T_local!r}")
    cu = None
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens: expected a 1-D integer torch.Tensor or None, got "
                            f"{type(cu_seqlens).__name__}")
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens: expected a 1-D int32 or int64 tensor, got "
                             f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
        cu = cu_seqlens.detach()
    if P == 1 or not gather:
        bounds = documents_bounds(cu)  # the one host read
        lengths = (T_local,) * P
    else:
        dev = _row_device(group, cu)
        n = -1 if cu is None else cu.numel()
        digest = torch.zeros((), dtype=torch.int64, device=dev) if cu is None or not n \
            else tensor_digest([cu.to(dev)])
        row = torch.cat([torch.tensor([T_local, n], dtype=torch.int64, device=dev),
                         digest.to(dev)[None]])
        table = gather_words(row, group, P, "plan_batch", timeout_s)
        parts = [table.flatten()] + ([] if cu is None else [cu.to(dev, torch.int64)])
        words = torch.cat(parts).tolist()  # the one host read: the table and the offsets
        rows = [words[3 * r: 3 * r + 3] for r in range(P)]
        _agree(rows)
        lengths = tuple(int(r[0]) for r in rows)
        bounds = None if cu is None else tuple(int(c) for c in words[3 * P:])
        if bounds is not None and len(bounds) < 2:
            raise ValueError(f"cu_seqlens: expected a 1-D tensor of N + 1 >= 2 offsets, got "
                             f"({len(bounds)},)")
    if bounds is not None:
        check_bounds(bounds, None)
    problems = call_problems(layout, lengths, bounds)
    if problems:  # built from agreed facts: the same text on every rank
        raise ValueError("SequenceParallel.plan_batch: " + "; ".join(problems))
    return BatchPlan(T_local=T_local, T=sum(lengths), bounds=bounds,
                     digest=bounds_digest(bounds), rank=rank, lengths=lengths,
                     layout=layout, pieces=tuple(layout_pieces(layout, list(lengths))),
                     group=group)


def _agree(rows: list[list[int]]) -> None:
    """The same ValueError on every rank when the ranks' offsets differ (the table is
    the same everywhere)."""
    seen: dict[tuple[int, int], list[int]] = {}
    for r, (_, n, digest) in enumerate(rows):
        seen.setdefault((n, digest), []).append(r)
    if len(seen) > 1:
        shown = ", ".join(
            ("None" if n < 0 else f"{n - 1} documents (digest {d & (2**64 - 1):016x})")
            + f" on ranks {rs}" for (n, d), rs in seen.items())
        raise ValueError("SequenceParallel.plan_batch: the ranks of the group disagree on "
                         f"this batch: cu_seqlens differs across ranks: {shown}")

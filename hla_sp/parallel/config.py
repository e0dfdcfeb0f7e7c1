"""``SequenceParallel``: the validated description of how a sequence is sharded.

Each public call checks, once and with one small all-gather, that every rank of the
group agrees on the call (shapes, dtype, layout, method, operator and options,
document boundaries) before any summary is exchanged. A mismatch raises the same
ValueError on every rank, naming what differs and on which ranks, instead of
hanging in a later collective. :meth:`SequenceParallel.check_call` returns the call's
:class:`~hla_sp.parallel.plan.Plan`, which the caller hands to every primitive stage
of the call: ``SequenceParallel`` itself is configuration. It implements the protocol
:class:`hla_sp.ops.sharding.SequenceParallelism` that the operators call.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hla_sp.ops.validate import Inputs
from hla_sp.parallel.comm import all_gather_single, count
from hla_sp.parallel.layouts import LAYOUTS, layout_pieces
from hla_sp.parallel.plan import Chain, Plan
from hla_sp.parallel.primitive import sp_primitive

METHODS = ("allgather", "ring", "tree")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Fields of the per-rank metadata row, in order; names appear in error messages.
_FIELDS = (
    "B", "H", "K", "V", "dtype", "layout", "method", "operator", "options",
    "cu_seqlens", "grad mode", "local T",
)
_OPS = ("linear_attention", "hla2", "ahla", "hla3")


def _hash63(data: bytes) -> int:
    """A hash that is the same in every process (Python's hash() of str is salted)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


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

    group: dist.ProcessGroup | None = None
    """The process group; None for the default (WORLD) group."""
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

    def __post_init__(self) -> None:
        if self.group is not None and not isinstance(self.group, dist.ProcessGroup):
            raise TypeError(
                f"group: expected a torch.distributed.ProcessGroup or None, "
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
        return self.group if self.group is not None else dist.group.WORLD

    @property
    def rank(self) -> int:
        return dist.get_rank(self._group())

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self._group())

    def check_call(self, inputs: Inputs, *, op: str, options: tuple) -> Plan:
        """Check that every rank agrees on this call; raise the same error everywhere.

        One all-gather of a small int64 row per rank. Returns the call's :class:`Plan`,
        which every primitive stage of the call takes (``plan=``).
        """
        group = self._group()
        rank, P = dist.get_rank(group), dist.get_world_size(group)
        cu = inputs.cu_seqlens
        bounds = None if cu is None else tuple(int(c) for c in cu.tolist())
        row = self._metadata_row(inputs, op, options, bounds)
        table = self._gather_rows(row, inputs.q.device, group, P, op)
        lengths = tuple(r[-1] for r in table)
        problems = _disagreements(table) or self._call_problems(lengths, bounds)
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

    def _metadata_row(
        self, inputs: Inputs, op: str, options: tuple, bounds: tuple[int, ...] | None
    ) -> list[int]:
        """This rank's view of the call, one int per field of ``_FIELDS``."""
        return [
            inputs.B, inputs.H, inputs.K, inputs.V,
            _DTYPES.index(inputs.q.dtype),
            LAYOUTS.index(self.layout),
            METHODS.index(self.method),
            _OPS.index(op) if op in _OPS else _hash63(op.encode()),
            _hash63(repr(tuple(options)).encode()),
            -1 if bounds is None else _hash63(repr(bounds).encode()),
            int(torch.is_grad_enabled()),
            inputs.T,
        ]

    def _gather_rows(
        self, row: list[int], device: torch.device, group: dist.ProcessGroup, P: int, op: str
    ) -> list[list[int]]:
        """Every rank's row [P][len(row)], waiting at most ``check_timeout_s``."""
        mine = torch.tensor(row, dtype=torch.int64, device=device)
        rows = mine.new_empty(P * len(row))
        if P == 1:
            rows.copy_(mine)
            return rows.view(P, len(row)).cpu().tolist()
        work = all_gather_single(rows, mine, group=group, async_op=True)
        count("meta", (P - 1) * mine.numel() * mine.element_size())
        try:
            if self.check_timeout_s is None:
                work.wait()
            else:
                work.wait(timeout=timedelta(seconds=self.check_timeout_s))
        except RuntimeError as e:
            raise RuntimeError(
                f"SequenceParallel: not every rank of the group joined the agreement "
                f"check of this {op} call within {self.check_timeout_s} s (a rank may "
                f"have failed its own argument checks or stopped); the group's state "
                f"is now undefined, restart it. ({e})"
            ) from e
        return rows.view(P, len(row)).cpu().tolist()

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


def _disagreements(table: list[list[int]]) -> list[str]:
    """Describe every metadata field (except local T) whose value differs across ranks."""
    out = []
    for j, name in enumerate(_FIELDS[:-1]):
        values: dict[int, list[int]] = {}
        for r, row in enumerate(table):
            values.setdefault(row[j], []).append(r)
        if len(values) > 1:
            shown = ", ".join(f"{_show(name, v)} on ranks {rs}" for v, rs in values.items())
            out.append(f"{name} differs: {shown}")
    return out


def _show(name: str, v: int) -> str:
    if name == "dtype":
        return str(_DTYPES[v])
    if name == "layout":
        return repr(LAYOUTS[v])
    if name == "method":
        return repr(METHODS[v])
    if name == "cu_seqlens":
        return "None" if v == -1 else f"hash {v:x}"
    if name == "operator":
        return repr(_OPS[v]) if 0 <= v < len(_OPS) else f"hash {v:x}"
    if name == "options":
        return f"hash {v:x}"
    return str(v)

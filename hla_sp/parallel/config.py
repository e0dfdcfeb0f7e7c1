"""``SequenceParallel``: the validated description of how a sequence is sharded.

Each public call checks, once and with one small all-gather, that every rank of the
group agrees on the call (shapes, dtype, layout, method, operator and options,
document boundaries) before any summary is exchanged. A mismatch raises the same
ValueError on every rank, naming what differs and on which ranks, instead of
hanging in a later collective. The gathered local lengths become the call's
:class:`Plan`, which every primitive stage of the call reuses.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hla_sp.parallel import exchange
from hla_sp.parallel.layouts import LAYOUTS, Piece, layout_pieces

if TYPE_CHECKING:
    from hla_sp.ops.validate import Inputs

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
class Plan:
    """What every rank knows about one public call after :meth:`SequenceParallel.check_call`."""

    rank: int
    world_size: int
    group: dist.ProcessGroup
    lengths: list[int]  # local T of every rank
    pieces: list[Piece]  # every piece, in global order
    T: int  # global sequence length
    needs_grad: bool  # grad mode is on: every rank builds the backward collectives
    token: torch.Tensor | None  # orders this call's collectives in backward (exchange.py)
    key: tuple[int, tuple[int, ...] | None]  # (local T, cu_seqlens) the plan was made for

    def for_backward(self) -> Plan:
        """This plan without its token, for an autograd context to keep.

        A context holding the plan itself would close a cycle (plan -> token ->
        grad_fn -> context -> plan) through autograd nodes, which Python's collector
        cannot see: every call's graph and saved tensors would leak.
        """
        return dataclasses.replace(self, token=None)

    @property
    def own(self) -> list[Piece]:
        """This rank's pieces in local (slot) order."""
        return sorted((p for p in self.pieces if p.owner == self.rank), key=lambda p: p.slot)

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)


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
    _plan: Plan | None = field(default=None, init=False, repr=False, compare=False)

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

    def check_call(self, inputs: Inputs, *, op: str, options: tuple) -> None:
        """Check that every rank agrees on this call; raise the same error everywhere.

        One all-gather of a small int64 row per rank. On success, records the
        call's :class:`Plan` for the primitive stages that follow.
        """
        group = self._group()
        rank, P = dist.get_rank(group), dist.get_world_size(group)
        cu = inputs.cu_seqlens
        cu_key = None if cu is None else tuple(int(c) for c in cu.tolist())
        row = [
            inputs.B, inputs.H, inputs.K, inputs.V,
            _DTYPES.index(inputs.q.dtype),
            LAYOUTS.index(self.layout),
            METHODS.index(self.method),
            _OPS.index(op) if op in _OPS else _hash63(op.encode()),
            _hash63(repr(tuple(options)).encode()),
            -1 if cu_key is None else _hash63(repr(cu_key).encode()),
            int(torch.is_grad_enabled()),
            inputs.T,
        ]
        mine = torch.tensor(row, dtype=torch.int64, device=inputs.q.device)
        rows = mine.new_empty(P * len(row))
        if P > 1:
            work = exchange.all_gather_single(rows, mine, group=group, async_op=True)
            exchange.count("meta", (P - 1) * mine.numel() * mine.element_size())
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
        else:
            rows.copy_(mine)
        table = rows.view(P, len(row)).cpu().tolist()
        problems = _disagreements(table)
        lengths = [r[-1] for r in table]
        total = sum(lengths)
        if not problems:
            if cu_key is not None and cu_key[-1] != total:
                problems.append(
                    f"cu_seqlens[-1] = {cu_key[-1]} but the local lengths {lengths} "
                    f"(ranks 0..{P - 1}) sum to {total}"
                )
            if total == 0:
                problems.append("every rank's shard is empty (global T = 0)")
            if self.layout == "zigzag" and (len(set(lengths)) != 1 or lengths[0] % 2):
                problems.append(
                    f"zigzag layout needs the same even local T on every rank, got {lengths}"
                )
        if problems:
            # The same text on every rank: it is built from the gathered table only.
            raise ValueError(
                "SequenceParallel: the ranks of the group disagree on this call: "
                + "; ".join(problems)
            )
        needs_grad = torch.is_grad_enabled()
        token = torch.zeros((), dtype=torch.float32, requires_grad=needs_grad)
        self._plan = Plan(
            rank, P, group, lengths, layout_pieces(self.layout, lengths), total,
            needs_grad, token, (inputs.T, cu_key),
        )

    def plan_for(self, q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> Plan:
        """The plan of the current call; the primitive stages of a call share it."""
        cu_key = None if cu_seqlens is None else tuple(int(c) for c in cu_seqlens.tolist())
        plan = self._plan
        if plan is None or plan.key != (q.shape[1], cu_key):
            raise RuntimeError(
                "SequenceParallel: no checked call matches this shard (local T = "
                f"{q.shape[1]}); the public operators call sp.check_call(...) before "
                "their primitive stages, and a direct call of primitive(..., sp=sp) must too"
            )
        return plan


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

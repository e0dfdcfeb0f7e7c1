"""``SequenceParallel``: the validated description of how a sequence is sharded.

Each public call checks, once and with one small all-gather, that every rank of the
group agrees on the call (shapes, dtype, layout, method, operator, scale, whether
log_decay is given and its kind (per token, or a per-head constant and a digest of its
values), each named option (an initial state: whether it is given and a digest of its
values), document boundaries) before any summary is exchanged. A mismatch raises the
same ValueError on every rank, naming what differs, its value on each rank and on
which ranks, instead of hanging in a later collective or silently computing with one
rank's values. :meth:`SequenceParallel.check_call` returns the call's
:class:`~hla_sp.parallel.plan.Plan`, which the caller hands to every primitive stage
of the call: ``SequenceParallel`` itself is configuration. It implements the protocol
:class:`hla_sp.ops.sharding.SequenceParallelism` that the operators call.
"""

from __future__ import annotations

import hashlib
import re
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hla_sp.ops.validate import Inputs

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
from hla_sp.parallel.comm import all_gather_single, count
from hla_sp.parallel.layouts import LAYOUTS, layout_pieces
from hla_sp.parallel.plan import Chain, Plan
from hla_sp.parallel.primitive import sp_primitive

METHODS = ("allgather", "ring", "tree")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Fields of the per-rank metadata row, in order; names appear in error messages. The
# options follow them, _MAX_OPTIONS slots of (kind, payload); local T is the last int.
_FIELDS = (
    "B", "H", "K", "V", "dtype", "layout", "method", "operator", "scale", "log_decay",
    "log_decay values", "option names", "cu_seqlens", "grad mode",
)
_MAX_OPTIONS = 10
_OPS = ("linear_attention", "hla2", "ahla", "hla3")
# log_decay kinds (row field "log_decay"); the last matches either given kind.
_DECAY_KINDS = ("None", "per token", "per-head constant", "given (shard of < 2 tokens)")
_UNKNOWN_KIND = 3
# Option value kinds (first int of an option's slot); 0 is an unused slot.
_NONE, _BOOL, _INT, _FLOAT, _STR, _TENSOR = 1, 2, 3, 4, 5, 6


def _hash63(data: bytes) -> int:
    """A hash that is the same in every process (Python's hash() of str is salted)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def _float_bits(x: float) -> int:
    """The IEEE bits of a float as an int64 (exact, decoded by :func:`_bits_float`)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


_MIX1, _MIX2, _MIX3 = 0x2545F4914F6CDD1D, 0x9E3779B97F4A7C1 * 2 + 1, 0x5851F42D4C957F2D


def _digest(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """An int64 digest of the values (as fp64) and shapes of ``tensors``, computed on
    their device (no host synchronization): equal values give equal digests on every
    rank; changing any one element always changes it (an odd weight per position)."""
    dev = next(t.device for t in tensors if t is not None)
    acc = torch.zeros((), dtype=torch.int64, device=dev)
    for i, t in enumerate(tensors):
        acc = acc * _MIX3 + (_hash63(repr((i, None if t is None else tuple(t.shape))).encode()))
        if t is None or t.numel() == 0:
            continue
        # + 0.0 makes -0.0 into +0.0: equal values, equal bits.
        bits = (t.detach().to(device=dev, dtype=torch.float64) + 0.0).contiguous()
        bits = bits.view(torch.int64).flatten()
        weight = torch.arange(bits.numel(), device=dev, dtype=torch.int64) * (2 * _MIX1) + _MIX2
        h = bits * weight
        h = (h ^ _shr(h, 29)) * _MIX1
        acc = acc + h.sum()
    # A final mix so that every bit of the digest depends on every bit of the sum.
    acc = (acc ^ _shr(acc, 31)) * _MIX3
    return acc ^ _shr(acc, 29)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _decay_kind(g: torch.Tensor | None) -> tuple[int, torch.Tensor | None]:
    """(kind index in ``_DECAY_KINDS``, the values of a per-head constant [B, H] or
    None). A log_decay broadcast over tokens (an [H] or [B, 1, H] tensor broadcast to
    [B, T, H], stride 0 over T) is a per-head constant, replicated on every rank, so
    its values must agree; a per-token log_decay is sharded like q. A shard of fewer
    than 2 tokens cannot tell the two apart (a size-1 dimension's stride means
    nothing): it only says that a log_decay is given."""
    if g is None:
        return 0, None
    if g.shape[1] < 2:
        return _UNKNOWN_KIND, None
    if g.stride(1) == 0:
        B, _, H = g.shape
        return 2, g.detach().as_strided((B, H), (g.stride(0), g.stride(2)), g.storage_offset())
    return 1, None


def _named_options(options: object) -> list[tuple[str, object]]:
    """A mapping name -> value, or a sequence of (name, value) pairs, as a list."""
    if isinstance(options, Mapping):
        pairs = list(options.items())
    elif isinstance(options, Sequence) and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in options
    ):
        pairs = list(options)  # type: ignore[arg-type]
    else:
        raise TypeError(
            "options: expected a mapping name -> value or a sequence of (name, value) "
            f"pairs, got {options!r}"
        )
    if len(pairs) > _MAX_OPTIONS:
        raise ValueError(f"options: expected at most {_MAX_OPTIONS} options, got {len(pairs)}")
    return pairs


def _encode_option(value: object) -> tuple[int, int | None, list[torch.Tensor | None] | None]:
    """(kind, payload, tensors to digest instead of the payload) of an option value."""
    if value is None:
        return _NONE, 0, None
    if isinstance(value, bool):
        return _BOOL, int(value), None
    if isinstance(value, int) and -(1 << 63) <= value < (1 << 63):
        return _INT, value, None
    if isinstance(value, float):
        return _FLOAT, _float_bits(value), None
    if isinstance(value, str):
        return _STR, _hash63(value.encode()), None
    items = list(value) if isinstance(value, (tuple, list)) else [value]
    if items and all(t is None or isinstance(t, torch.Tensor) for t in items):
        if all(t is None for t in items):
            return _NONE, 0, None
        return _TENSOR, None, items  # type: ignore[return-value]
    raise TypeError(
        "options: expected values that are None, bool, int, float, str, a tensor or a "
        f"tuple of tensors (None allowed), got {type(value).__name__}"
    )


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
        return self.group if self.group is not None else dist.group.WORLD

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
        named = _named_options(options)
        row = self._metadata_row(inputs, op, named, bounds)
        table = self._gather_rows(row, group, P, op)
        lengths = tuple(r[-1] for r in table)
        names = [n for n, _ in named]
        problems = _disagreements(table, names) or self._call_problems(lengths, bounds)
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
        self,
        inputs: Inputs,
        op: str,
        options: list[tuple[str, object]],
        bounds: tuple[int, ...] | None,
    ) -> torch.Tensor:
        """This rank's view of the call: one int64 per field of ``_FIELDS``, then
        ``_MAX_OPTIONS`` (kind, payload) slots, then the local T, on q's device. Value
        digests are computed there (no host synchronization)."""
        device = inputs.q.device
        kind, constant = _decay_kind(inputs.g)
        ints = [
            inputs.B, inputs.H, inputs.K, inputs.V,
            _DTYPES.index(inputs.q.dtype),
            LAYOUTS.index(self.layout),
            METHODS.index(self.method),
            _OPS.index(op) if op in _OPS else _hash63(op.encode()),
            _float_bits(inputs.scale),
            kind,
            0,  # log_decay values: the digest below
            _hash63(repr(tuple(n for n, _ in options)).encode()),
            -1 if bounds is None else _hash63(repr(bounds).encode()),
            int(torch.is_grad_enabled()),
        ]
        digests: list[tuple[int, list[torch.Tensor | None]]] = []
        if constant is not None:
            digests.append((_FIELDS.index("log_decay values"), [constant]))
        slots = [0] * (2 * _MAX_OPTIONS)
        for i, (_, value) in enumerate(options):
            code, payload, tensors = _encode_option(value)
            slots[2 * i] = code
            if tensors is None:
                slots[2 * i + 1] = payload  # type: ignore[assignment]
            else:
                digests.append((len(_FIELDS) + 2 * i + 1, tensors))
        row = torch.tensor(ints + slots + [inputs.T], dtype=torch.int64, device=device)
        for j, tensors in digests:
            row[j] = _digest(tensors).to(device)
        return row

    def _gather_rows(
        self, mine: torch.Tensor, group: dist.ProcessGroup, P: int, op: str
    ) -> list[list[int]]:
        """Every rank's row [P][len(row)], waiting at most ``check_timeout_s``."""
        n = mine.numel()
        rows = mine.new_empty(P * n)
        if P == 1:
            rows.copy_(mine)
            return rows.view(P, n).cpu().tolist()
        start = time.monotonic()
        work = all_gather_single(rows, mine, group=group, async_op=True)
        count("meta", (P - 1) * mine.numel() * mine.element_size())
        try:
            if self.check_timeout_s is None:
                work.wait()
            else:
                work.wait(timeout=timedelta(seconds=self.check_timeout_s))
        except RuntimeError as e:
            raise RuntimeError(_join_failure(op, e, time.monotonic() - start,
                                             self.check_timeout_s)) from e
        return rows.view(P, n).cpu().tolist()

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


def _join_failure(op: str, e: RuntimeError, elapsed: float, timeout: float | None) -> str:
    """The message of a failed agreement check: the real cause and elapsed time first."""
    cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    cause = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", cause)  # gloo's source location
    restart = "the group's state is now undefined, restart it"
    if timeout is not None and elapsed >= 0.95 * timeout:
        return (
            f"SequenceParallel: not every rank of the group joined the agreement check "
            f"of this {op} call within {timeout} s (waited {elapsed:.1f} s; a rank may "
            f"have failed its own argument checks or stopped); {restart}. ({cause})"
        )
    return (
        f"SequenceParallel: the agreement check of this {op} call failed after "
        f"{elapsed:.1f} s: {cause}. A peer rank likely crashed or closed its connection "
        f"(look for its own error first); {restart}."
    )


def _is_device_mesh(x: object) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # a torch without DeviceMesh: nothing can be one
        return False
    return isinstance(x, DeviceMesh)


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


def _disagreements(table: list[list[int]], names: list[str]) -> list[str]:
    """Describe every field whose value differs across ranks (not local T): the fixed
    fields, then each option by its name (the names are this rank's, the same on
    every rank once the option names agree, so the text is the same everywhere)."""
    out = []
    kind = _FIELDS.index("log_decay")
    kinds = {row[kind] for row in table}
    # A log_decay on one rank and none on another, or a per-head constant on one and
    # a per-token one on another, differ; a shard too short to tell matches either.
    kinds_differ = (0 in kinds and len(kinds) > 1) or {1, 2} <= kinds
    constants = [r for r, row in enumerate(table) if row[kind] == 2]
    for j, name in enumerate(_FIELDS):
        rows = table
        if name == "log_decay" and not kinds_differ:
            continue
        if name == "log_decay values":
            if kinds_differ:
                continue  # the kinds differ: that is the message
            rows = [table[r] if r in constants else None for r in range(len(table))]
        shown = _differs([None if row is None else row[j] for row in rows],
                         lambda v, name=name: _show(name, v))
        if shown:
            out.append(f"{name} differs: {shown}")
    if any(p.startswith(("operator ", "option names ")) for p in out):
        return out  # different calls: their options are not comparable
    for i, name in enumerate(names):
        k = len(_FIELDS) + 2 * i
        shown = _differs([(row[k], row[k + 1]) for row in table], _show_option)
        if shown:
            out.append(f"option {name!r} differs: {shown}")
    return out


def _differs(column: list, show) -> str:
    """'A on ranks [..], B on ranks [..]' when the column's values differ, else ''."""
    values: dict[object, list[int]] = {}
    for r, v in enumerate(column):
        if v is not None:  # None: this rank does not take part in the comparison
            values.setdefault(v, []).append(r)
    if len(values) < 2:
        return ""
    return ", ".join(f"{show(v)} on ranks {rs}" for v, rs in values.items())


def _show_option(slot: tuple[int, int]) -> str:
    kind, v = slot
    if kind == _NONE:
        return "None"
    if kind == _BOOL:
        return str(bool(v))
    if kind == _INT:
        return str(v)
    if kind == _FLOAT:
        return repr(_bits_float(v))
    if kind == _TENSOR:
        return f"given with values digest {v & (2**64 - 1):016x}"
    return f"hash {v:x}"


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
    if name == "scale":
        return repr(_bits_float(v))
    if name == "log_decay":
        return _DECAY_KINDS[v]
    if name == "log_decay values":
        return f"digest {v & (2**64 - 1):016x}"
    if name == "option names":
        return f"hash {v:x}"
    return str(v)

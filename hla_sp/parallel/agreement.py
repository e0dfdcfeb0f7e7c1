"""The per-call agreement check of :class:`~hla_sp.parallel.SequenceParallel`.

Each rank encodes its view of a call as one int64 metadata row (shapes, dtype, layout,
method, operator, scale, the log_decay kind and a digest of a per-head constant, the
named options as (kind, payload) slots with digests of their tensors, the document
boundaries, grad mode, local T); one all-gather gives every rank the whole table, and
the disagreement messages are built from that table only, so every rank raises the
same text.
"""

from __future__ import annotations

import hashlib
import re
import struct
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from hla_sp.ops.validate import Inputs
from hla_sp.parallel.comm import all_gather_single, count
from hla_sp.parallel.layouts import LAYOUTS
from hla_sp.parallel.plan import METHODS

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


def named_options(options: object) -> list[tuple[str, object]]:
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


def metadata_row(
    inputs: Inputs,
    op: str,
    options: list[tuple[str, object]],
    bounds: tuple[int, ...] | None,
    *,
    layout: str,
    method: str,
) -> torch.Tensor:
    """This rank's view of the call: one int64 per field of ``_FIELDS``, then
    ``_MAX_OPTIONS`` (kind, payload) slots, then the local T, on q's device. Value
    digests are computed there (no host synchronization)."""
    device = inputs.q.device
    kind, constant = _decay_kind(inputs.g)
    ints = [
        inputs.B, inputs.H, inputs.K, inputs.V,
        _DTYPES.index(inputs.q.dtype),
        LAYOUTS.index(layout),
        METHODS.index(method),
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


def gather_rows(
    mine: torch.Tensor, group: dist.ProcessGroup, P: int, op: str, timeout_s: float | None
) -> list[list[int]]:
    """Every rank's row [P][len(row)], waiting at most ``timeout_s`` (None: the group's
    own timeout)."""
    n = mine.numel()
    rows = mine.new_empty(P * n)
    if P == 1:
        rows.copy_(mine)
        return rows.view(P, n).cpu().tolist()
    start = time.monotonic()
    work = all_gather_single(rows, mine, group=group, async_op=True)
    count("meta", (P - 1) * mine.numel() * mine.element_size())
    try:
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise RuntimeError(_join_failure(op, e, time.monotonic() - start,
                                         timeout_s)) from e
    return rows.view(P, n).cpu().tolist()


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



def disagreements(table: list[list[int]], names: list[str]) -> list[str]:
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

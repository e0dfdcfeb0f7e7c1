"""The per-call agreement check of :class:`~hla_sp.parallel.SequenceParallel`.

Each rank encodes its view of a call as one int64 metadata row of fixed width (shapes,
dtype, layout, method, the call's name, scale, the log_decay kind and a digest of a
per-head constant, the document boundaries, grad mode; then the named options, each
as its name, value kind and value; local T last); one all-gather gives every rank the
whole table, and the disagreement messages are built from that table only, so every
rank raises the same text.

Messages name what differs and its value on each rank, e.g. ``short_conv differs
across ranks: 4 on ranks [0], 2 on ranks [1]``. So texts (the call's name, option
names, str values such as ``precision``) travel as text, not as a hash: a hash of the
whole text (which decides equality) and its first 24 UTF-8 bytes (which are shown;
a longer text is shown cut, with its hash); so do the document offsets. Only tensors
(an initial state, a per-head log_decay) are compared by a digest, shown as such.
"""

from __future__ import annotations

import re
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from hla_sp.ops.validate import Inputs
from hla_sp.parallel.comm import all_gather_single, count
from hla_sp.parallel.digests import DECAY_KINDS, decay_kind, hash63, tensor_digest
from hla_sp.parallel.layouts import LAYOUTS
from hla_sp.parallel.plan import METHODS

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# int64 words of a text in the row: a hash of all of it, then its first 24 UTF-8 bytes
# (the call names, option names and str values in use fit).
_TEXT = 4
# The fixed fields of the per-rank metadata row, in order, with their widths in int64
# words; names appear in error messages. cu_seqlens: the number of documents (-1 for
# None) and the offsets as a text.
_FIELDS: tuple[tuple[str, int], ...] = (
    ("B", 1), ("H", 1), ("K", 1), ("V", 1), ("dtype", 1), ("layout", 1), ("method", 1),
    ("operator", _TEXT), ("scale", 1), ("log_decay", 1), ("log_decay values", 1),
    ("cu_seqlens", 1 + _TEXT), ("grad mode", 1),
)
_AT = {name: sum(w for _, w in _FIELDS[:i]) for i, (name, _) in enumerate(_FIELDS)}
_OPTIONS_AT = sum(w for _, w in _FIELDS)  # the first option slot's first word
# The options follow, _MAX_OPTIONS slots of (name, kind, value); local T is the last int.
_MAX_OPTIONS = 10
_SLOT = 2 * _TEXT + 1
# Option value kinds (the slot's kind word); 0 is an unused slot.
_NONE, _BOOL, _INT, _FLOAT, _STR, _TENSOR = 1, 2, 3, 4, 5, 6


def _float_bits(x: float) -> int:
    """The IEEE bits of a float as an int64 (exact, decoded by :func:`_bits_float`)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


def _text_words(text: str) -> list[int]:
    """``_TEXT`` int64 words of a text: a hash of all of it, then its first UTF-8 bytes."""
    raw = text.encode()
    body = raw[: 8 * (_TEXT - 1)].ljust(8 * (_TEXT - 1), b"\0")
    return [hash63(raw), *struct.unpack(f"<{_TEXT - 1}q", body)]


def _read_text(words: Sequence[int]) -> tuple[str, bool]:
    """The text of :func:`_text_words` and whether it is whole (not cut by the row)."""
    raw = struct.pack(f"<{_TEXT - 1}q", *words[1:_TEXT]).rstrip(b"\0")
    return raw.decode("utf-8", "replace"), hash63(raw) == words[0]


def _show_text(words: Sequence[int], quote: bool = True) -> str:
    """The text of :func:`_text_words` (quoted: ``repr``); one too long for the row is
    shown cut, with the hash of all of it (two long texts may share their first bytes)."""
    text, whole = _read_text(words)
    shown = repr(text) if quote else text
    return shown if whole else f"{shown}... (hash {words[0]:x})"


def named_options(options: object) -> list[tuple[str, object]]:
    """A mapping name -> value, or a sequence of (name, value) pairs, as a list."""
    if isinstance(options, Mapping):
        pairs = list(options.items())
    elif isinstance(options, Sequence) and all(
        isinstance(p, tuple) and len(p) == 2 for p in options
    ):
        pairs = list(options)  # type: ignore[arg-type]
    else:
        raise TypeError(
            "options: expected a mapping name -> value or a sequence of (name, value) "
            f"pairs, got {options!r}"
        )
    bad = [n for n, _ in pairs if not isinstance(n, str)]
    if bad:
        raise TypeError(f"options: expected str names, got {bad[0]!r}")
    if len(pairs) > _MAX_OPTIONS:
        raise ValueError(f"options: expected at most {_MAX_OPTIONS} options, got {len(pairs)}")
    return pairs


def encode_option(value: object) -> tuple[int, list[int], list[torch.Tensor | None] | None]:
    """(kind, ``_TEXT`` value words, tensors whose digest is the first word, or None)."""
    pad = [0] * (_TEXT - 1)
    if value is None:
        return _NONE, [0, *pad], None
    if isinstance(value, bool):
        return _BOOL, [int(value), *pad], None
    if isinstance(value, int) and -(1 << 63) <= value < (1 << 63):
        return _INT, [value, *pad], None
    if isinstance(value, float):
        return _FLOAT, [_float_bits(value), *pad], None
    if isinstance(value, str):
        return _STR, _text_words(value), None
    tensors = option_tensors(value)
    return (_NONE, [0, *pad], None) if tensors is None else (_TENSOR, [0, *pad], tensors)


def is_plain(value: object) -> bool:
    """An option value compared exactly: None, a bool, an int64, a float or a str."""
    return (value is None or isinstance(value, (bool, float, str))
            or (isinstance(value, int) and -(1 << 63) <= value < (1 << 63)))


def option_tensors(value: object) -> list[torch.Tensor | None] | None:
    """The tensors of an option value that is a tensor or a tuple of tensors (None
    allowed), compared by digest; None for a plain value or only Nones. Any other
    value is a TypeError."""
    if is_plain(value):
        return None
    items = list(value) if isinstance(value, (tuple, list)) else [value]
    if items and all(t is None or isinstance(t, torch.Tensor) for t in items):
        return None if all(t is None for t in items) else items  # type: ignore[return-value]
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
    """This rank's view of the call, an int64 row on q's device, of the same width on
    every rank: the words of ``_FIELDS``, then ``_MAX_OPTIONS`` slots of (name, kind,
    value), then the local T.
    Value digests are computed there (no host synchronization)."""
    device = inputs.q.device
    kind, constant = decay_kind(inputs.g)
    cu = [-1] + [0] * _TEXT if bounds is None else [
        len(bounds) - 1, *_text_words(",".join(str(b) for b in bounds))]
    ints = [
        inputs.B, inputs.H, inputs.K, inputs.V,
        _DTYPES.index(inputs.q.dtype),
        LAYOUTS.index(layout),
        METHODS.index(method),
        *_text_words(op),
        _float_bits(inputs.scale),
        kind,
        0,  # log_decay values: the digest below
        *cu,
        int(torch.is_grad_enabled()),
    ]
    digests: list[tuple[int, list[torch.Tensor | None]]] = []
    if constant is not None:
        digests.append((_AT["log_decay values"], [constant]))
    slots = [0] * (_MAX_OPTIONS * _SLOT)
    for i, (name, value) in enumerate(options):
        code, words, tensors = encode_option(value)
        slots[i * _SLOT : (i + 1) * _SLOT] = [*_text_words(name), code, *words]
        if tensors is not None:
            digests.append((_OPTIONS_AT + i * _SLOT + _TEXT + 1, tensors))
    row = torch.tensor(ints + slots + [inputs.T], dtype=torch.int64, device=device)
    for j, tensors in digests:
        row[j] = tensor_digest(tensors).to(device)
    return row


def gather_rows(
    mine: torch.Tensor, group: dist.ProcessGroup, P: int, op: str, timeout_s: float | None
) -> list[list[int]]:
    """Every rank's row [P][len(row)], waiting at most ``timeout_s`` (None: the group's
    own timeout)."""
    return gather_words(mine, group, P, op, timeout_s).cpu().tolist()


def gather_words(
    mine: torch.Tensor, group: dist.ProcessGroup, P: int, op: str, timeout_s: float | None
) -> torch.Tensor:
    """Every rank's row, [P, len(row)] on the row's device (not read on the host: the
    caller reads it, with whatever else it needs, in one transfer)."""
    n = mine.numel()
    rows = mine.new_empty(P * n)
    if P == 1:
        rows.copy_(mine)
        return rows.view(P, n)
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
    return rows.view(P, n)


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


def disagreements(table: list[list[int]], names: Sequence[str] | None = None) -> list[str]:
    """Describe every field whose value differs across ranks (not local T), each as
    ``<name> differs across ranks: <value> on ranks [..], <value> on ranks [..]``: the
    fixed fields, then the options by name. ``names`` (optional) are this rank's option
    names, shown in full where the row holds only their first bytes; they are only
    used once every rank's names agree, so the text is the same on every rank."""
    out = []
    k = _AT["log_decay"]
    kinds = {row[k] for row in table}
    # A log_decay on one rank and none on another, or a per-head constant on one and
    # a per-token one on another, differ; a shard too short to tell matches either.
    kinds_differ = (0 in kinds and len(kinds) > 1) or {1, 2} <= kinds
    constants = [r for r, row in enumerate(table) if row[k] == 2]
    calls_differ = False
    for name, width in _FIELDS:
        j = _AT[name]
        rows: list[list[int] | None] = list(table)
        if name == "log_decay" and not kinds_differ:
            continue
        if name == "log_decay values":
            if kinds_differ:
                continue  # the kinds differ: that is the message
            rows = [table[r] if r in constants else None for r in range(len(table))]
        column = [None if row is None else tuple(row[j : j + width]) for row in rows]
        shown = _differs(column, _SHOW.get(name, _show_int))
        if shown:
            out.append(f"{name} differs across ranks: {shown}")
            calls_differ = calls_differ or name == "operator"
    if calls_differ:
        return out  # different calls: their options are not comparable
    slots = [[tuple(row[_OPTIONS_AT + i * _SLOT : _OPTIONS_AT + (i + 1) * _SLOT])
              for i in range(_MAX_OPTIONS)] for row in table]
    used = [[s for s in rank_slots if s[_TEXT]] for rank_slots in slots]  # kind 0: unused
    shown = _differs([tuple(s[:_TEXT] for s in u) for u in used], _show_names)
    if shown:
        out.append(f"option names differ across ranks: {shown}")
        return out
    for i, slot in enumerate(used[0]):
        label = names[i] if names is not None and i < len(names) else _show_text(slot, quote=False)
        shown = _differs([u[i][_TEXT:] for u in used], _show_option)
        if shown:
            out.append(f"{label} differs across ranks: {shown}")
    return out


def _differs(column: list, show: Callable[[tuple[int, ...]], str]) -> str:
    """'A on ranks [..], B on ranks [..]' when the column's values differ, else ''."""
    values: dict[object, list[int]] = {}
    for r, v in enumerate(column):
        if v is not None:  # None: this rank does not take part in the comparison
            values.setdefault(v, []).append(r)
    if len(values) < 2:
        return ""
    return ", ".join(f"{show(v)} on ranks {rs}" for v, rs in values.items())


def _show_names(names: tuple[tuple[int, ...], ...]) -> str:
    return "[" + ", ".join(_show_text(n) for n in names) + "]"


def _show_option(slot: tuple[int, ...]) -> str:
    """An option's (kind, value words) as text."""
    kind, v = slot[0], slot[1]
    if kind == _NONE:
        return "None"
    if kind == _BOOL:
        return str(bool(v))
    if kind == _INT:
        return str(v)
    if kind == _FLOAT:
        return repr(_bits_float(v))
    if kind == _STR:
        return _show_text(slot[1:])
    return f"given with values digest {v & (2**64 - 1):016x}"  # _TENSOR


def _show_int(w: tuple[int, ...]) -> str:
    return str(w[0])


def _show_cu(w: tuple[int, ...]) -> str:
    """The offsets, as many as the row holds (then their number and hash)."""
    if w[0] == -1:
        return "None"
    text, whole = _read_text(w[1:])
    if whole:
        return "[" + text.replace(",", ", ") + "]"
    head = text[: text.rfind(",")].replace(",", ", ")  # whole numbers only
    return f"{w[0]} documents, offsets [{head}, ...] (hash {w[1]:x})"


# How a fixed field's words read in a message (default: the int).
_SHOW: dict[str, Callable[[tuple[int, ...]], str]] = {
    "dtype": lambda w: str(_DTYPES[w[0]]),
    "layout": lambda w: repr(LAYOUTS[w[0]]),
    "method": lambda w: repr(METHODS[w[0]]),
    "operator": _show_text,
    "scale": lambda w: repr(_bits_float(w[0])),
    "log_decay": lambda w: DECAY_KINDS[w[0]],
    "log_decay values": lambda w: f"digest {w[0] & (2**64 - 1):016x}",
    "cu_seqlens": _show_cu,
    "grad mode": lambda w: "on" if w[0] else "off",
}

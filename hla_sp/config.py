"""The HLA options, defined once: :class:`HLAConfig`.

Torch-free on purpose: flag parsers (Megatron's ``--hla-*`` flags, the trainer's) read
it without paying for a torch import. The choices are ``Literal`` types, the tuples
(:data:`DECAYS`, :data:`SP_METHODS`) are derived from them, and the command-line flags
are generated from the fields (:meth:`HLAConfig.add_flags`). The operators' names and
the options only some of them take come from :data:`BUILTIN_OPERATORS`, this module's
copy of what the operator table (``hla_sp.ops.operators``) says. The layer takes
:meth:`HLAConfig.heads_kwargs`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, get_args


class OperatorFacts(NamedTuple):
    """What the torch-free readers need of an operator: the options only it takes
    (the other operators must leave them at their defaults) and whether Megatron's
    core-attention slot takes it (``linear`` is the layer's first-order baseline)."""

    options: tuple[str, ...] = ()
    higher_order: bool = True


# The built-in operators. The operator table (hla_sp.ops.operators, which needs torch)
# holds everything about them and fails at import unless its entries say the same as
# this copy; it is here because this module is the lowest layer and torch-free. An
# operator registered on the table at run time is added to _REGISTERED below.
BUILTIN_OPERATORS: dict[str, OperatorFacts] = {
    "hla2": OperatorFacts(("normalize", "eps", "ridge")),
    "ahla": OperatorFacts(),
    "hla3": OperatorFacts(),
    "ccq": OperatorFacts(),
    "linear": OperatorFacts(higher_order=False),
}
_REGISTERED: dict[str, OperatorFacts] = {}

Operator = str  # a name of operator_names()
Decay = Literal["none", "fixed", "learned", "data"]
# The exchange methods' names, the one list of them. Their functions (forward start,
# reverse start) are registered under these names in ``hla_sp.parallel.exchange``'s
# table, which fails at import unless its names are exactly these: the names live here
# because this module is the lowest layer and torch-free, and the table needs torch.
# SequenceParallel, Plan and the flags' choices derive from here.
SPMethod = Literal["allgather", "ring", "tree"]
Precision = Literal["auto", "exact", "fast"]

OPERATORS: tuple[str, ...] = tuple(BUILTIN_OPERATORS)
DECAYS: tuple[str, ...] = get_args(Decay)
SP_METHODS: tuple[str, ...] = get_args(SPMethod)
PRECISIONS: tuple[str, ...] = get_args(Precision)
# The operators Megatron's core-attention slot takes.
HLA_OPERATORS: tuple[str, ...] = tuple(n for n, f in BUILTIN_OPERATORS.items() if f.higher_order)


def operator_facts() -> dict[str, OperatorFacts]:
    """Every operator's facts: the built-in ones, then those registered at run time."""
    return {**BUILTIN_OPERATORS, **_REGISTERED}


def operator_names() -> tuple[str, ...]:
    """The names :class:`HLAConfig` accepts as ``operator``."""
    return tuple(operator_facts())


def hla_operator_names() -> tuple[str, ...]:
    """The operators Megatron's core-attention slot takes (``--attention``): the
    higher-order built-ins, then those registered at run time."""
    return tuple(n for n, f in operator_facts().items() if f.higher_order)


# names an operator may not take: the mixers that are not operators (--attention softmax)
RESERVED = ("softmax",)


def add_operator(name: str, facts: OperatorFacts) -> None:
    """Accept ``name`` as an operator (called by the operator table's ``register``)."""
    if not isinstance(name, str) or not name or name in operator_facts() or name in RESERVED:
        raise ValueError(f"name: expected a new operator name, got {name!r} "
                         f"(taken: {(*operator_names(), *RESERVED)})")
    own = {f.name for f in dataclasses.fields(HLAConfig)}
    unknown = [o for o in facts.options if o not in own]
    if unknown:
        raise ValueError(f"options: expected HLAConfig fields, got {unknown}")
    _REGISTERED[name] = facts


def remove_operator(name: str) -> None:
    """Undo :func:`add_operator` (built-in operators stay)."""
    if name not in _REGISTERED:
        raise ValueError(f"name: expected a registered operator {tuple(_REGISTERED)}, "
                         f"got {name!r}")
    del _REGISTERED[name]


# The layer's keyword arguments (HLAHeads / HLAttention), in their order.
_HEADS_FIELDS = (
    "operator", "decay", "qk_norm", "output_norm", "first_order", "mix_norm", "short_conv",
    "normalize",
    "eps", "ridge", "scale", "chunk_size", "precision",
)


def _flag(help: str, **kw: Any) -> dict[str, Any]:
    """Field metadata of an option that is also a ``--hla-*`` flag."""
    return {"help": help, **kw}


@dataclass(frozen=True)
class HLAConfig:
    """The options of HLA attention; frozen, checked on construction."""

    operator: Operator = "hla2"
    """The operator: hla2, ahla, hla3 (HLA), or linear (first order, a baseline)."""
    decay: Decay = field(default="learned", metadata=_flag(
        "HLA decay: none, fixed (RetNet schedule), learned (per head), data (per token gate)."))
    """none, fixed (RetNet schedule per kv head), learned (per-kv-head parameter) or
    data (per token). Learned is the default: stable at long context without tuning."""
    qk_norm: bool = True
    """L2-normalise q and k per head."""
    output_norm: bool = True
    """Per-head RMSNorm of the operator's output."""
    first_order: bool = field(default=True, metadata=_flag(
        "HLA operators keep a first-order path: the outer stage reads k + a*k~ and v + b*u "
        "with learned per-head a, b (zero at the start). Without it they do not learn recall."))
    """hla2/ahla/hla3: keep a first-order path in the outer stage, k + a k~ (hla2, hla3)
    and v + b u (ahla, hla3), a and b learned per head and zero at the start. It is
    what makes the higher-order operators learn from context (docs/quality.md)."""
    mix_norm: bool = field(default=False, metadata=_flag(
        "With the first-order path: scale k~ and u to unit norm per token before a and b "
        "weigh them, so the higher-order term does not grow with the context."))
    """With ``first_order``: scale the mixed-in k~ (hla2, hla3) and u (ahla, hla3) to unit
    L2 norm per token and head. k~ = S q grows with the tokens summed into S, so without
    it a fixed a weighs the higher-order term more the later the token (docs/quality.md)."""
    short_conv: int = field(default=4, metadata=_flag(
        "Taps of the short causal convolution (with SiLU) on q, k, v before the operator; "
        "0 turns it off."))
    """Taps W of a depthwise causal convolution over time on q, k and v (SiLU after),
    exact across documents, decode states and sequence-parallel ranks; 0 turns it off.
    It lets every operator match a key to the token after it (docs/quality.md)."""
    normalize: bool = field(default=False, metadata=_flag(
        "hla2 only: divide by the paper's normaliser (can be near zero)."))
    """hla2 only: divide by the paper's normaliser q^T eta (eps added)."""
    eps: float = 1e-6
    """hla2 only: added to the normaliser."""
    ridge: float = field(default=0.0, metadata=_flag("hla2 only: lambda of S + lambda I."))
    """hla2 only: lambda of S + lambda I."""
    scale: float | None = None
    """Query scale; None means head_dim ** -0.5."""
    chunk_size: int = field(default=64, metadata=_flag(
        "Chunk length of the chunk-parallel path (a power of two)."))
    """Chunk length of the chunk-parallel path, a power of two."""
    precision: Precision = field(default="auto", metadata=_flag(
        "What the HLA stages exchange: exact (fp32), fast (16-bit operands, fp32 "
        "accumulation, k~/u rounded once per stage), auto (fast for 16-bit on CUDA)."))
    """"exact": the stages of hla2/ahla/hla3 run in fp32 (16-bit inputs rounded once);
    "fast": 16-bit inputs keep 16-bit operands with fp32 accumulation, the
    intermediates rounded once per stage; "auto": fast for 16-bit inputs on CUDA,
    exact elsewhere."""
    sp_method: SPMethod = field(default="allgather", metadata=_flag(
        "Exchange of the segment summaries across the context-parallel group."))
    """Exchange of the segment summaries across a sequence-parallel group."""

    def __post_init__(self) -> None:
        for name, choices in (("operator", operator_names()), ("decay", DECAYS),
                              ("sp_method", SP_METHODS), ("precision", PRECISIONS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}: expected one of {choices}, got {getattr(self, name)!r}")
        for name in ("qk_norm", "output_norm", "first_order", "mix_norm", "normalize"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        for name in ("eps", "ridge"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not (
                math.isfinite(x) and x >= 0
            ):
                raise ValueError(f"{name}: expected a finite number >= 0, got {x!r}")
        # An option only some operators take (hla2's normalize, eps, ridge) must keep
        # its default under the others.
        facts = operator_facts()
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in sorted({o for f in facts.values() for o in f.options}):
            if name not in facts[self.operator].options and getattr(self, name) != defaults[name]:
                takers = ", ".join(repr(n) for n, f in facts.items() if name in f.options)
                raise ValueError(f"{name}: only operator {takers} has it, got operator "
                                 f"{self.operator!r}")
        s = self.scale
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float))
                              or not (math.isfinite(s) and s > 0)):
            raise ValueError(f"scale: expected a finite number > 0 or None, got {s!r}")
        w = self.short_conv
        if isinstance(w, bool) or not isinstance(w, int) or w < 0 or w == 1:
            raise ValueError(f"short_conv: expected 0 (off) or a number of taps >= 2, got {w!r}")
        c = self.chunk_size
        if isinstance(c, bool) or not isinstance(c, int) or c < 1 or c & (c - 1):
            raise ValueError(f"chunk_size: expected a power of two, got {c!r}")

    def heads_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``hla_sp.nn.HLAHeads`` / ``HLAttention``:
        operator, decay, qk_norm, output_norm, first_order, mix_norm, short_conv,
        normalize, eps, ridge, scale, chunk_size, precision."""
        return {name: getattr(self, name) for name in _HEADS_FIELDS}

    def replace(self, **changes: Any) -> HLAConfig:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def flag_fields(cls) -> list[dataclasses.Field]:
        """The fields that are command-line flags ``--hla-<name>``, in order."""
        return [f for f in dataclasses.fields(cls) if "help" in f.metadata]

    @classmethod
    def add_flags(cls, group: Any, prefix: str = "--hla-") -> list[str]:
        """Add one flag per :meth:`flag_fields` field to an argparse parser or group;
        returns the option strings (``--hla-normalize`` also adds ``--no-hla-normalize``)."""
        defaults = cls()
        added = []
        for f in cls.flag_fields():
            flag = prefix + f.name.replace("_", "-")
            default = getattr(defaults, f.name)
            kw: dict[str, Any] = {"default": default, "help": f.metadata["help"]}
            choices = _CHOICES.get(f.name)
            if choices is not None:
                kw["choices"] = choices
            elif isinstance(default, bool):
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = _PARSERS[f.name]
            group.add_argument(flag, **kw)
            added.append(flag)
            if isinstance(default, bool):
                added.append("--no-" + flag[2:])
        return added

    @classmethod
    def from_flags(cls, args: Any, operator: str, prefix: str = "hla_") -> HLAConfig:
        """The config of parsed flags (``args.hla_decay`` ..., or a dict of argparse's
        destinations) with ``operator``."""
        flags = args if isinstance(args, dict) else vars(args)
        values = {f.name: flags[prefix + f.name] for f in cls.flag_fields()
                  if prefix + f.name in flags}
        return cls(operator=operator, **values)


def _power_of_two(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a power of two, got {text!r}") from None
    if n < 1 or n & (n - 1):
        raise argparse.ArgumentTypeError(f"expected a power of two, got {n}")
    return n


def _nonneg_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite float >= 0, got {text!r}") from None
    if not (math.isfinite(x) and x >= 0):  # inf would reach the operator as a bare error
        raise argparse.ArgumentTypeError(f"expected a finite float >= 0, got {x}")
    return x


_CHOICES: dict[str, tuple[str, ...]] = {
    "operator": OPERATORS, "decay": DECAYS, "sp_method": SP_METHODS,
    "precision": PRECISIONS,
}
def _taps(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 0 or an int >= 2, got {text!r}") from None
    if n < 0 or n == 1:
        raise argparse.ArgumentTypeError(f"expected 0 or an int >= 2, got {n}")
    return n


_PARSERS = {"ridge": _nonneg_float, "chunk_size": _power_of_two, "short_conv": _taps}

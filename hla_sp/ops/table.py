"""The operator table: one entry per operator, keyed by its config name.

An :class:`OperatorSpec` holds everything the package needs of an operator: its state
(type and fields), its stages (the compositions of :mod:`hla_sp.ops.stages`), which
inputs of its outer stage take the layer's first-order mix, the options only it takes,
its public function and its reference. The config's choices, the runner
(:mod:`hla_sp.ops.runner`), the layer's parameters, the agreement check's call name and
Megatron's layer specs all read it. This module is a leaf: it imports no runner, so
the runner and the public functions can both import it. The built-in entries are added by
:mod:`hla_sp.ops.operators`, next to their public functions; adding an operator:
docs/operators.md.

``hla_sp.config`` (torch-free, for flag parsers) keeps a copy of the built-in names and
their options; :mod:`hla_sp.ops.operators` fails at import unless the copy matches,
and :func:`register` adds an operator to both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hla_sp.config import OperatorFacts, add_operator, remove_operator
from hla_sp.ops import validate
from hla_sp.ops.stages import StagesFn

DEFAULT_EPS = 1e-6
# The options an entry may list: name -> (default, check). They are HLAConfig fields.
OPTIONS: dict[str, tuple[Any, Callable[[str, object], Any]]] = {
    "normalize": (False, validate.check_bool),
    "eps": (DEFAULT_EPS, validate.check_nonneg),
    "ridge": (0.0, validate.check_nonneg),
}


@dataclass(frozen=True)
class Field:
    """A field of an operator's state: [N, heads, *dims], ``heads`` the kv heads (shared
    by a GQA group: the state of a stage whose keys and values are k, v) or the query
    heads; with ``when``, present only when that option is on (eta: "normalize")."""

    name: str
    heads: Literal["kv", "q"]
    dims: tuple[Literal["K", "V"], ...]
    when: str | None = None


@dataclass(frozen=True)
class OperatorSpec:
    """One operator.

    Attributes:
        name: the config name (``HLAConfig.operator``), also the agreement check's
            name for a call of it.
        state_type: the NamedTuple of its state, fields in the order of ``fields``.
        fields: the state's fields.
        stages: (ctx, qs, k, v, state0) -> (o, final fields); see
            :data:`hla_sp.ops.stages.StagesFn`.
        public: its public function, (q, k, v, *, log_decay, scale, initial_state,
            output_final_state, cu_seqlens, sp, chunk_size, its options[, precision]).
        reference: the serial recurrence it must equal, (q, k, v, log_decay, scale,
            initial_state=..., its options) -> (o, final state).
        key_mix, value_mix: whether its outer stage takes the first-order mix of the
            key (k + a k~; ccq: of the query, q + a S q) or of the value (v + b u).
        options: the options only it takes (keys of :data:`OPTIONS`).
        higher_order: whether Megatron's core-attention slot takes it.
        precision: whether ``public`` takes ``precision`` (one stage has nothing to
            exchange between stages, so ``linear_attention`` does not).
        bare_state: whether ``public`` takes and returns the state's one tensor
            instead of the tuple.
        scale_in_kernels: whether its stages take ``qs`` unscaled, with the scale in
            ``ctx.scale``: the primitive calls then multiply q by it inside the kernels,
            with no pass of their own. Stages that use q other than as a query must
            apply ``ctx.scale`` themselves (hla2's ridge term), and a stage whose output
            is a query again runs at ``scale=1.0`` (ccq). Off by default: a registered
            operator's stages then get q scaled, as before.
    """

    name: str
    state_type: type
    fields: tuple[Field, ...]
    stages: StagesFn
    public: Callable[..., Any]
    reference: Callable[..., Any]
    key_mix: bool = False
    value_mix: bool = False
    options: tuple[str, ...] = ()
    higher_order: bool = True
    precision: bool = True
    bare_state: bool = False
    scale_in_kernels: bool = False

    def facts(self) -> OperatorFacts:
        """The torch-free part that ``hla_sp.config`` holds."""
        return OperatorFacts(self.options, self.higher_order)


TABLE: dict[str, OperatorSpec] = {}


def get(name: object) -> OperatorSpec:
    """The entry of operator ``name``; a ValueError names the choices."""
    validate.check_choice("operator", name, tuple(TABLE))
    return TABLE[name]  # type: ignore[index]


def state_fields(operator: str, n: int, hq: int, hkv: int, K: int, V: int,
                 normalize: bool = False, **options: object) -> dict[str, tuple[int, ...] | None]:
    """Field name -> shape of ``operator``'s state for n sequences, hq query and hkv kv
    heads (None: absent for these options; a field's ``when`` names one of them)."""
    on = {"normalize": normalize, **options}
    heads = {"kv": hkv, "q": hq}
    dims = {"K": K, "V": V}
    return {f.name: None if f.when is not None and not on.get(f.when) else
            (n, heads[f.heads], *(dims[d] for d in f.dims)) for f in get(operator).fields}


def check_options(spec: OperatorSpec, given: Mapping[str, object]) -> dict[str, Any]:
    """The values of ``spec``'s options, checked (missing ones at their defaults); an
    option it does not take must be absent or at its default."""
    unknown = sorted(set(given) - set(OPTIONS))
    if unknown:
        raise TypeError(f"options: expected names among {tuple(OPTIONS)}, got {unknown}")
    for name, value in given.items():
        if name not in spec.options and value != OPTIONS[name][0]:
            raise ValueError(f"{name}: operator {spec.name!r} does not take it, got {value!r}")
    return {n: OPTIONS[n][1](n, given.get(n, OPTIONS[n][0])) for n in spec.options}


def register(spec: OperatorSpec) -> None:
    """Add ``spec`` to the table (and its name to ``hla_sp.config``'s choices), once its
    public function equals its ``reference`` on a small fp64 input
    (:mod:`hla_sp.ops.self_check`; a ValueError otherwise, nothing registered). Names of
    the built-in mixers (the operators, ``softmax``) are refused."""
    if not isinstance(spec, OperatorSpec):
        raise TypeError(f"spec: expected an OperatorSpec, got {type(spec).__name__}")
    unknown = [o for o in spec.options if o not in OPTIONS]
    if unknown:
        raise ValueError(f"spec.options: expected names among {tuple(OPTIONS)}, got {unknown}")
    if not isinstance(spec.scale_in_kernels, bool):
        raise TypeError(f"spec.scale_in_kernels: expected a bool, got "
                        f"{type(spec.scale_in_kernels).__name__}")
    add_operator(spec.name, spec.facts())  # refuses a name already taken
    TABLE[spec.name] = spec
    from hla_sp.ops import self_check

    try:
        self_check.check(spec)  # its stages against its reference, fp64, a small input
    except BaseException:
        unregister(spec.name)
        raise


def unregister(name: str) -> None:
    """Remove an operator added by :func:`register` (built-in operators stay)."""
    remove_operator(name)  # refuses a built-in or unknown name
    del TABLE[name]


@contextlib.contextmanager
def registered(spec: OperatorSpec) -> Iterator[OperatorSpec]:
    """``spec`` registered for the duration of the ``with`` block."""
    register(spec)
    try:
        yield spec
    finally:
        unregister(spec.name)

"""The operator table: one entry per operator, keyed by its config name.

An :class:`OperatorSpec` holds everything the package needs of an operator: its state
(type and fields), its stages (the compositions below), which inputs of its
outer stage take the layer's first-order mix, the options only it takes, its public
function and its reference. The config's choices, the runner
(:mod:`hla_sp.ops.runner`), the layer's parameters, the agreement check's call name and
Megatron's layer specs all read it. This module is a leaf: it imports no runner, so
the runner and the public functions can both import it. The built-in entries are added by
:mod:`hla_sp.ops.operators`, next to their public functions; adding an operator:
docs/operators.md.

``hla_sp.config`` (torch-free, for flag parsers) keeps a copy of the built-in names and
their options; :mod:`hla_sp.ops.operators` fails at import unless the copy matches,
and :func:`register` adds an operator to both.

The stages, compositions of the primitive:

    linear = LA(q, k, v)                         state (h,)
    hla2 = LA(q, LA(q, k, k), v)                 state (S, H[, eta])
    ahla = LA(q, k, LA(q, k, v))                 state (C, H)
    hla3 = LA(q, LA(q, k, k), LA(q, k, v))       state (S, C, H)
    ccq = LA(LA(q, k, k), k, v)                  state (S, h)

Every stage is one call of :func:`hla_sp.ops.primitive.primitive` (bound into a
:class:`StageContext` by the caller), so kernels, gradients and sequence parallelism
come from the primitive alone. The runner (:mod:`hla_sp.ops.runner`) calls them.
What passes between the stages is chosen by ``precision`` (:mod:`hla_sp.ops.dispatch`):
the compute dtype (fp32, or fp64), so that 16-bit inputs are rounded once at the output
("exact"), or the 16-bit dtype itself, rounded once per stage ("fast", the default on
CUDA).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch

from hla_sp.config import OperatorFacts, add_operator, remove_operator
from hla_sp.ops import validate
from hla_sp.ops.dispatch import LOW_PRECISION

DEFAULT_EPS = 1e-6
# Added to |x|^2 by the mix norm: below |x| ~ 1e-3 the unit vector fades out linearly
# instead of amplifying noise (a k~ from one token is |k| |q.k| and can be that small).
MIX_NORM_EPS = 1e-6


class LinearState(NamedTuple):
    """State of ``linear``: h [N, Hkv, K, V] (shared by a GQA group)."""

    h: torch.Tensor


class HLA2State(NamedTuple):
    """State of ``hla2``: S [N, H, K, K] key moment, H [N, H, K, V], eta [N, H, K] or None."""

    S: torch.Tensor
    H: torch.Tensor
    eta: torch.Tensor | None = None


class AHLAState(NamedTuple):
    """State of ``ahla``: C [N, H, K, V] (inner, first order) and H [N, H, K, V] (outer)."""

    C: torch.Tensor
    H: torch.Tensor


class CCQState(NamedTuple):
    """State of ``ccq``: S [N, H, K, K] key moment and h [N, H, K, V] (both shared by a
    GQA group: their stages read the kv heads' k and v)."""

    S: torch.Tensor
    h: torch.Tensor


class HLA3State(NamedTuple):
    """State of ``hla3``: S [N, H, K, K], C [N, H, K, V] and H [N, H, K, V]."""

    S: torch.Tensor
    C: torch.Tensor
    H: torch.Tensor


def with_denominator(
    v: torch.Tensor, H0: torch.Tensor | None, eta0: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hla2's normaliser as the same stage: a ones column appended to v [B, T, H, V]
    (the denominator's value) and eta0 [N, H, K] to H0 [N, H, K, V] (its state)."""
    v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    if H0 is not None:
        H0 = torch.cat([H0, eta0[..., None].to(H0.dtype)], dim=-1)
    return v, H0


def split_denominator(
    o: torch.Tensor, Hf: torch.Tensor | None, V: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Undo :func:`with_denominator`: o [.., V + 1] -> o / (den + eps); Hf -> (H, eta).
    A 16-bit o (the fast path) is divided in fp32: eps and a small den are not rounded."""
    o = o.float() if o.dtype in LOW_PRECISION else o
    o = o[..., :V] / (o[..., V:] + eps)
    if Hf is None:
        return o, None, None
    return o, Hf[..., :V], Hf[..., V]


# A stage: (q [B, T, Hq, K], keys, values, h0) -> (out, final state or None). The log-decay,
# documents, chunk size and sequence parallelism are bound in by the caller.
Stage = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"],
    "tuple[torch.Tensor, torch.Tensor | None]",
]


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class StageContext:
    """What the stages of one call share.

    ``shared`` runs a stage whose keys and values are ``k``/``v`` (their heads own the
    state: S, C, h); ``per_head`` one whose keys or values are per query head (H, eta).
    With grouped keys (GQA) ``expand`` maps a kv-head tensor to the query heads;
    without, both stages are the plain primitive and ``expand`` the identity.

    The first-order path (the layer's ``first_order``): with ``key_mix`` a, the outer
    stage's key is k + a k~ instead of k~ (:meth:`key`); with ``value_mix`` b, its value
    is v + b u instead of u (:meth:`value`). The outer stage is linear in its key and
    value, so hla2 becomes LA(q, k, v) + a hla2 and ahla LA(q, k, v) + b ahla at no
    extra stage; hla3 gains all four terms (first order, a hla2, b ahla, ab hla3). ccq
    puts the same a on its query instead (:meth:`query`): LA(q + a S q, k, v) is
    LA(q, k, v) + a ccq.
    With ``mix_norm`` the mixed-in k~ and u are first scaled to unit L2 norm per token
    and head: k~ = S q grows with the tokens summed into S (a power of t without decay),
    so a fixed a would weigh the higher-order term more the later the token.

    ``key_mix``, ``value_mix``: per query head weights [Hq] (compute dtype), or None.
    ``options``: the operator's own options (hla2: normalize, eps, ridge), checked.
    """

    shared: Stage
    per_head: Stage
    expand: Callable[[torch.Tensor], torch.Tensor] = _same
    key_mix: torch.Tensor | None = None
    value_mix: torch.Tensor | None = None
    mix_norm: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)

    def key(self, higher: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The outer stage's key [B, T, Hq, K]: k + a k~ with ``key_mix`` a, else k~."""
        return _mix(higher, self.key_mix, lambda: self.expand(k), self.mix_norm)

    def query(self, higher: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
        """The outer stage's query [B, T, Hq, K]: q + a q~ with ``key_mix`` a, else q~
        (``qs`` is already per query head, so nothing is expanded)."""
        return _mix(higher, self.key_mix, lambda: qs, self.mix_norm)

    def value(self, higher: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The outer stage's value [B, T, Hq, V]: v + b u with ``value_mix`` b, else u."""
        return _mix(higher, self.value_mix, lambda: self.expand(v), self.mix_norm)


# The stages of each operator: (ctx, qs [B, T, Hq, K] scaled, or unscaled when the
# entry's ``scale_in_kernels`` says so for the call's options (every primitive call of
# the stages then scales it in the kernels), k [B, T, Hkv, K],
# v [B, T, Hkv, V] in the compute dtype, the initial state's fields in the order of the
# state tuple) -> (o [B, T, Hq, V] in the compute dtype, the final state's fields).
StagesFn = Callable[
    [StageContext, torch.Tensor, torch.Tensor, torch.Tensor, "list[torch.Tensor | None]"],
    "tuple[torch.Tensor, list[torch.Tensor | None]]",
]


def linear_stages(ctx: StageContext, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  state0: list[torch.Tensor | None]):
    """linear = LA(q, k, v): one shared stage."""
    o, h = ctx.shared(qs, k, v, state0[0])
    return o, [h]


def hla2_stages(ctx: StageContext, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                state0: list[torch.Tensor | None]):
    """hla2 = LA(q, k~, v) with k~ = LA(q, k, k) (+ ridge q); normalize divides by
    q^T eta, eta the state of a ones column appended to v."""
    S0, H0, eta0 = state0
    normalize, ridge, eps = (ctx.options[n] for n in ("normalize", "ridge", "eps"))
    k_tilde, S = ctx.shared(qs, k, k, S0)  # k~_t = S_t q_t
    if ridge:
        k_tilde = k_tilde + ridge * qs
    k_tilde = ctx.key(k_tilde, k)
    vq = ctx.expand(v)
    V = vq.shape[-1]
    if normalize:
        vq, H0 = with_denominator(vq, H0, eta0)
    o, Hf = ctx.per_head(qs, k_tilde, vq, H0)
    eta = None
    if normalize:
        o, Hf, eta = split_denominator(o, Hf, V, eps)
    return o, [S, Hf, eta]


def ahla_stages(ctx: StageContext, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                state0: list[torch.Tensor | None]):
    """ahla = LA(q, k, u) with u = LA(q, k, v)."""
    C0, H0 = state0
    u, C = ctx.shared(qs, k, v, C0)  # u_t = C_t^T q_t
    o, Hf = ctx.per_head(qs, ctx.expand(k), ctx.value(u, v), H0)
    return o, [C, Hf]


def hla3_stages(ctx: StageContext, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                state0: list[torch.Tensor | None]):
    """hla3 = LA(q, k~, u) with k~ = LA(q, k, k) and u = LA(q, k, v)."""
    S0, C0, H0 = state0
    k_tilde, S = ctx.shared(qs, k, k, S0)
    u, C = ctx.shared(qs, k, v, C0)
    o, Hf = ctx.per_head(qs, ctx.key(k_tilde, k), ctx.value(u, v), H0)
    return o, [S, C, Hf]


def ccq_stages(ctx: StageContext, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               state0: list[torch.Tensor | None]):
    """ccq = LA(q~, k, v) with q~ = LA(q, k, k) = S q: the query is contracted by the
    running key moment before it reads the first-order state (CCQ, arXiv 2606.01294).
    Both stages read the kv heads' k, so both states are shared by a GQA group."""
    S0, h0 = state0
    q_tilde, S = ctx.shared(qs, k, k, S0)  # q~_t = S_t q_t
    o, h = ctx.shared(ctx.query(q_tilde, qs), k, v, h0)
    return o, [S, h]


def _mix(
    higher: torch.Tensor, weight: torch.Tensor | None, first: Callable[[], torch.Tensor],
    norm: bool = False,
) -> torch.Tensor:
    """first() + weight * higher per query head ([B, T, Hq, D], weight [Hq]); higher alone
    without a weight (``first`` is only built when used: under GQA it is an expansion).
    With ``norm``, higher is first scaled to unit L2 norm per token and head."""
    if weight is None:
        return higher
    if norm:
        higher = unit_norm(higher)
    return torch.addcmul(first(), weight[:, None].to(higher.dtype), higher)


def unit_norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(|x|^2 + MIX_NORM_EPS) over the last dim; 16-bit x is normalised in fp32
    and rounded once."""
    xf = x.float() if x.dtype in LOW_PRECISION else x
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + MIX_NORM_EPS)).to(x.dtype)

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
            :data:`hla_sp.ops.table.StagesFn`.
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
        scale_in_kernels: (options) -> whether, with those options, its stages read q
            only as the query of primitive calls whose outputs are not queries again:
            ``qs`` is then the unscaled q and every stage multiplies it by the scale
            inside the kernels, with no pass of its own (hla2 with ``ridge`` adds
            ridge q to k~, and ccq's second query is S q, already scaled: not those).
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
    scale_in_kernels: Callable[[Mapping[str, Any]], bool] = lambda options: False

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

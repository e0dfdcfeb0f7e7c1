"""The operator table: one entry per operator, keyed by its config name.

An :class:`OperatorSpec` holds everything the package needs of an operator: its state
(type and fields), its stages (:mod:`hla_sp.ops.compositions`), which inputs of its
outer stage take the layer's first-order mix, the options only it takes, its public
function and its reference. The config's choices, the grouped (GQA) form, the layer's
parameters, the agreement check's call name and Megatron's layer specs all read it.
Adding an operator: docs/operators.md.

``hla_sp.config`` (torch-free, for flag parsers) keeps a copy of the built-in names and
their options; this module fails at import unless the copy matches, and
:func:`register` adds an operator to both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from hla_sp.config import BUILTIN_OPERATORS, OperatorFacts, add_operator, remove_operator
from hla_sp.ops import compositions as C
from hla_sp.ops import reference as R
from hla_sp.ops import validate
from hla_sp.ops.linear_attention import DEFAULT_CHUNK_SIZE, linear_attention, primitive
from hla_sp.ops.precision import resolve, stage_dtype
from hla_sp.ops.sharding import BatchPlan, SequenceParallelism

# The options an entry may list: name -> (default, check). They are HLAConfig fields.
OPTIONS: dict[str, tuple[Any, Callable[[str, object], Any]]] = {
    "normalize": (False, validate.check_bool),
    "eps": (C.DEFAULT_EPS, validate.check_nonneg),
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
            :data:`hla_sp.ops.compositions.StagesFn`.
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
    """

    name: str
    state_type: type
    fields: tuple[Field, ...]
    stages: C.StagesFn
    public: Callable[..., Any]
    reference: Callable[..., Any]
    key_mix: bool = False
    value_mix: bool = False
    options: tuple[str, ...] = ()
    higher_order: bool = True
    precision: bool = True
    bare_state: bool = False

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


def call(
    operator: str,
    q: object,
    k: object,
    v: object,
    *,
    log_decay: object = None,
    scale: object = None,
    initial_state: object = None,
    output_final_state: bool = False,
    cu_seqlens: object = None,
    sp: SequenceParallelism | None = None,
    chunk_size: object = DEFAULT_CHUNK_SIZE,
    precision: str = "auto",
    plan: BatchPlan | None = None,
    **options: object,
) -> tuple[torch.Tensor, tuple | None]:
    """Run ``operator`` (q [B, T, Hq, K], k [B, T, Hkv, K], v [B, T, Hkv, V], Hkv
    dividing Hq) with the primitive as every stage: validate, agree across ``sp``'s
    ranks, run its stages (with Hkv < Hq: :func:`hla_sp.ops.grouped.grouped_operator`).
    Keywords as in :func:`hla_sp.hla2`; ``options``: the operator's own. Returns
    (o [B, T, Hq, V] in q's dtype, its state type or None)."""
    spec = get(operator)
    # grouped.py builds on this table: imported here, not at the top (an import cycle)
    from hla_sp.ops.grouped import grouped_operator, is_grouped

    if is_grouped(q, k):  # fewer kv heads than query heads: GQA/MQA
        return grouped_operator(
            spec.name, q, k, v, log_decay=log_decay, scale=scale,  # type: ignore[arg-type]
            initial_state=initial_state, output_final_state=output_final_state,  # type: ignore[arg-type]
            cu_seqlens=cu_seqlens, sp=sp, chunk_size=chunk_size,  # type: ignore[arg-type]
            precision=precision, plan=plan, **options)  # type: ignore[arg-type]
    x = validate.check_inputs(
        q, k, v, log_decay=log_decay, scale=scale, cu_seqlens=cu_seqlens, sp=sp,
        chunk_size=chunk_size, output_final_state=output_final_state, plan=plan,
    )
    opts = check_options(spec, options)
    precision = resolve(precision, x.q.dtype, x.q.device)
    fields = state_fields(spec.name, x.n_seq, x.H, x.H, x.K, x.V, **opts)
    state0 = validate.check_state_tuple(initial_state, fields, x.q)
    agreed = None
    if sp is not None:
        # output_final_state decides whether the final states are all-reduced: agree on it.
        agreed = sp.check_call(x, op=spec.name, options=dict(
            **opts, output_final_state=output_final_state, initial_state=state0,
            precision=precision))
    cdt = stage_dtype(precision, x.q.dtype)

    def stage(qs: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, h0: torch.Tensor | None):
        # every stage of the call carries its one plan (one ordering of its collectives)
        return primitive(
            qs, kk, vv, x.g, cu_seqlens=x.plan, h0=h0, want_final=output_final_state,
            chunk_size=x.chunk_size, sp=sp, plan=agreed,
        )

    o, final = spec.stages(C.StageContext(stage, stage, options=opts),
                           x.q.to(cdt) * x.scale, x.k.to(cdt), x.v.to(cdt), state0)
    state = spec.state_type(*final) if output_final_state else None
    return o.to(x.q.dtype), state


def register(spec: OperatorSpec) -> None:
    """Add ``spec`` to the table (and its name to ``hla_sp.config``'s choices)."""
    if not isinstance(spec, OperatorSpec):
        raise TypeError(f"spec: expected an OperatorSpec, got {type(spec).__name__}")
    unknown = [o for o in spec.options if o not in OPTIONS]
    if unknown:
        raise ValueError(f"spec.options: expected names among {tuple(OPTIONS)}, got {unknown}")
    add_operator(spec.name, spec.facts())  # refuses a name already taken
    TABLE[spec.name] = spec


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


def hla2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: torch.Tensor | None = None,
    normalize: bool = False,
    eps: float = C.DEFAULT_EPS,
    ridge: float = 0.0,
    scale: float | None = None,
    initial_state: C.HLA2State | tuple | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    sp: SequenceParallelism | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    precision: str = "auto",
    plan: BatchPlan | None = None,
) -> tuple[torch.Tensor, C.HLA2State | None]:
    """Masked second-order HLA: o_t = sum_{i<=j<=t} exp(A_t - A_i)(q_t.k_i)(k_i.q_j) v_j.

    Args:
        q: [B, T, H, K]. k: [B, T, Hkv, K]. v: [B, T, Hkv, V], with Hkv = H, or Hkv
            dividing H (GQA/MQA): the key moment S is then one per kv head, shared by
            its group of query heads; H (and eta) stay per query head.
        normalize: divide by den_t = q_t^T eta_t (eps added). den can be negative or
            near zero: that is the paper's definition, kept as is.
        ridge: lambda of the paper's S + lambda I.
        initial_state: :class:`C.HLA2State` (eta required iff ``normalize``); S must be
            symmetric, as every S the operators return (a non-symmetric one is refused).
        precision: "auto" | "exact" | "fast": what the stages exchange for 16-bit
            inputs (:mod:`hla_sp.ops.precision`); auto is fast on CUDA, exact elsewhere.
        plan: the batch's :class:`~hla_sp.ops.sharding.BatchPlan` instead of
            ``cu_seqlens`` (no host read).
        Other keywords as in :func:`hla_sp.linear_attention`.

    Returns:
        (o [B, T, H, V], C.HLA2State or None)
    """
    return call(  # type: ignore[return-value]
        "hla2", q, k, v, log_decay=log_decay, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, sp=sp,
        chunk_size=chunk_size, normalize=normalize, eps=eps, ridge=ridge, precision=precision,
        plan=plan,
    )


def ahla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: C.AHLAState | tuple | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    sp: SequenceParallelism | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    precision: str = "auto",
    plan: BatchPlan | None = None,
) -> tuple[torch.Tensor, C.AHLAState | None]:
    """Asymmetric HLA (AAV): o = ((W W) ⊙ L) V with W = L ⊙ QK^T, decay included.

    Keywords as in :func:`hla_sp.linear_attention` and ``precision`` as in
    :func:`hla2`; the state is :class:`C.AHLAState`.
    """
    return call(  # type: ignore[return-value]
        "ahla", q, k, v, log_decay=log_decay, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, sp=sp,
        chunk_size=chunk_size, precision=precision, plan=plan,
    )


def hla3(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: C.HLA3State | tuple | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    sp: SequenceParallelism | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    precision: str = "auto",
    plan: BatchPlan | None = None,
) -> tuple[torch.Tensor, C.HLA3State | None]:
    """Masked third-order HLA: o = (((W W^T) ⊙ L) W ⊙ L) V, middle index kept <= t.

    Keywords as in :func:`hla_sp.linear_attention` and ``precision`` as in
    :func:`hla2`; the state is :class:`C.HLA3State`.
    """
    return call(  # type: ignore[return-value]
        "hla3", q, k, v, log_decay=log_decay, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, sp=sp,
        chunk_size=chunk_size, precision=precision, plan=plan,
    )


def ccq(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: C.CCQState | tuple | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    sp: SequenceParallelism | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    precision: str = "auto",
    plan: BatchPlan | None = None,
) -> tuple[torch.Tensor, C.CCQState | None]:
    """Key-moment-contracted query: o_t = (S_t q_t)^T h_t with S_t = sum exp(A_t - A_i)
    k_i k_i^T and h_t = sum exp(A_t - A_j) k_j v_j^T, that is LA(LA(q, k, k), k, v).

    In the layer (``first_order``) the query becomes q + a S q, the idea of CCQ
    (arXiv 2606.01294). Keywords as in :func:`hla_sp.linear_attention` and
    ``precision`` as in :func:`hla2`; the state is :class:`C.CCQState`, both fields per
    kv head.
    """
    return call(  # type: ignore[return-value]
        "ccq", q, k, v, log_decay=log_decay, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, sp=sp,
        chunk_size=chunk_size, precision=precision, plan=plan,
    )


def _builtin(spec: OperatorSpec) -> None:
    TABLE[spec.name] = spec


# The fields of the built-in states: S = sum k k^T and C = sum k v^T per kv head (shared
# by a GQA group), the outer H per query head.
_KV_S = Field("S", "kv", ("K", "K"))
_KV_C = Field("C", "kv", ("K", "V"))
_Q_H = Field("H", "q", ("K", "V"))
_builtin(OperatorSpec(
    "hla2", C.HLA2State, (_KV_S, _Q_H, Field("eta", "q", ("K",), when="normalize")),
    C.hla2_stages, public=hla2, reference=R.recurrent_hla2,
    key_mix=True, options=("normalize", "eps", "ridge")))
_builtin(OperatorSpec(
    "ahla", C.AHLAState, (_KV_C, _Q_H), C.ahla_stages,
    public=ahla, reference=R.recurrent_ahla, value_mix=True))
_builtin(OperatorSpec(
    "hla3", C.HLA3State, (_KV_S, _KV_C, _Q_H), C.hla3_stages,
    public=hla3, reference=R.recurrent_hla3, key_mix=True, value_mix=True))
_builtin(OperatorSpec(
    "ccq", C.CCQState, (_KV_S, Field("h", "kv", ("K", "V"))), C.ccq_stages,
    public=ccq, reference=R.recurrent_ccq, key_mix=True))
_builtin(OperatorSpec(
    "linear", C.LinearState, (Field("h", "kv", ("K", "V")),), C.linear_stages,
    public=linear_attention, reference=R.recurrent_linear_attention, higher_order=False,
    precision=False, bare_state=True))
if {n: s.facts() for n, s in TABLE.items()} != BUILTIN_OPERATORS:
    raise RuntimeError(
        "hla_sp.config.BUILTIN_OPERATORS differs from the operator table: "
        f"{BUILTIN_OPERATORS} against {({n: s.facts() for n, s in TABLE.items()})}")

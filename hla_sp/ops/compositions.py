"""The higher-order operators, each a composition of the primitive.

    hla2 = LA(q, LA(q, k, k), v)                 state (S, H[, eta])
    ahla = LA(q, k, LA(q, k, v))                 state (C, H)
    hla3 = LA(q, LA(q, k, k), LA(q, k, v))       state (S, C, H)

Every stage is one call of :func:`hla_sp.ops.linear_attention.primitive`, so kernels,
gradients and sequence parallelism come from the primitive alone. What passes between
the stages is chosen by ``precision`` (:mod:`hla_sp.ops.precision`): the compute dtype
(fp32, or fp64), so that 16-bit inputs are rounded once at the output ("exact"), or
the 16-bit dtype itself, rounded once per stage ("fast", the default on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from hla_sp.ops import validate
from hla_sp.ops.linear_attention import DEFAULT_CHUNK_SIZE, primitive
from hla_sp.ops.precision import LOW_PRECISION, resolve, stage_dtype
from hla_sp.ops.sharding import BatchPlan, SequenceParallelism

DEFAULT_EPS = 1e-6
# Added to |x|^2 by the mix norm: below |x| ~ 1e-3 the unit vector fades out linearly
# instead of amplifying noise (a k~ from one token is |k| |q.k| and can be that small).
MIX_NORM_EPS = 1e-6


class HLA2State(NamedTuple):
    """State of ``hla2``: S [N, H, K, K] key moment, H [N, H, K, V], eta [N, H, K] or None."""

    S: torch.Tensor
    H: torch.Tensor
    eta: torch.Tensor | None = None


class AHLAState(NamedTuple):
    """State of ``ahla``: C [N, H, K, V] (inner, first order) and H [N, H, K, V] (outer)."""

    C: torch.Tensor
    H: torch.Tensor


class HLA3State(NamedTuple):
    """State of ``hla3``: S [N, H, K, K], C [N, H, K, V] and H [N, H, K, V]."""

    S: torch.Tensor
    C: torch.Tensor
    H: torch.Tensor


def _unpack_state(
    state: object, fields: dict[str, tuple[int, ...] | None], q: torch.Tensor
) -> list[torch.Tensor | None]:
    """Check a state tuple field by field; a None shape means the field must be absent."""
    return validate.check_state_tuple(state, fields, q)


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


def compose(
    operator: str,
    qs: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state0: list[torch.Tensor | None],
    *,
    shared: Stage,
    per_head: Stage,
    expand: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
    normalize: bool = False,
    ridge: float = 0.0,
    eps: float = DEFAULT_EPS,
    key_mix: torch.Tensor | None = None,
    value_mix: torch.Tensor | None = None,
    mix_norm: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The stages of ``operator`` ("hla2" | "ahla" | "hla3"), written once.

    ``shared`` runs a stage whose keys and values are ``k``/``v`` (their heads own the
    state: S, C); ``per_head`` one whose keys or values are per query head (H, eta).
    With grouped keys (GQA) ``expand`` maps a kv-head tensor to the query heads;
    without, all three are the plain primitive and the identity.

    The first-order path (the layer's ``first_order``): with ``key_mix`` a, the outer
    stage's key is k + a k~ instead of k~ (hla2, hla3); with ``value_mix`` b, its value
    is v + b u instead of u (ahla, hla3). The outer stage is linear in its key and
    value, so hla2 becomes LA(q, k, v) + a hla2 and ahla LA(q, k, v) + b ahla at no
    extra stage; hla3 gains all four terms (first order, a hla2, b ahla, ab hla3).
    With ``mix_norm`` the mixed-in k~ and u are first scaled to unit L2 norm per token
    and head: k~ = S q grows with the tokens summed into S (a power of t without decay),
    so a fixed a would weigh the higher-order term more the later the token.

    Args:
        qs: scaled queries [B, T, Hq, K]; k: [B, T, Hkv, K]; v: [B, T, Hkv, V] (compute
            dtype). state0: the initial state's fields in the order of the state tuple.
        key_mix, value_mix: per query head weights [Hq] (compute dtype), or None.
        mix_norm: unit-normalise what ``key_mix``/``value_mix`` weigh (no effect
            without them).

    Returns:
        (o [B, T, Hq, V] in the compute dtype, the final state's fields).
    """
    if operator == "hla2":
        S0, H0, eta0 = state0
        k_tilde, S = shared(qs, k, k, S0)  # k~_t = S_t q_t
        if ridge:
            k_tilde = k_tilde + ridge * qs
        k_tilde = _mix(k_tilde, key_mix, lambda: expand(k), mix_norm)
        vq = expand(v)
        V = vq.shape[-1]
        if normalize:
            vq, H0 = with_denominator(vq, H0, eta0)
        o, Hf = per_head(qs, k_tilde, vq, H0)
        eta = None
        if normalize:
            o, Hf, eta = split_denominator(o, Hf, V, eps)
        return o, [S, Hf, eta]
    if operator == "ahla":
        C0, H0 = state0
        u, C = shared(qs, k, v, C0)  # u_t = C_t^T q_t
        o, Hf = per_head(qs, expand(k), _mix(u, value_mix, lambda: expand(v), mix_norm), H0)
        return o, [C, Hf]
    if operator == "hla3":
        S0, C0, H0 = state0
        k_tilde, S = shared(qs, k, k, S0)
        u, C = shared(qs, k, v, C0)
        k_tilde = _mix(k_tilde, key_mix, lambda: expand(k), mix_norm)
        o, Hf = per_head(qs, k_tilde, _mix(u, value_mix, lambda: expand(v), mix_norm), H0)
        return o, [S, C, Hf]
    raise ValueError(f"operator: expected one of hla2, ahla, hla3, got {operator!r}")


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


STATE_TYPES: dict[str, type] = {"hla2": HLA2State, "ahla": AHLAState, "hla3": HLA3State}


def state_fields(
    operator: str, n: int, hq: int, hkv: int, K: int, V: int, normalize: bool = False
) -> dict[str, tuple[int, ...] | None]:
    """Field name -> shape of an operator's state (None: absent for these options)."""
    if operator == "hla2":
        return {"S": (n, hkv, K, K), "H": (n, hq, K, V), "eta": (n, hq, K) if normalize else None}
    if operator == "ahla":
        return {"C": (n, hkv, K, V), "H": (n, hq, K, V)}
    if operator == "hla3":
        return {"S": (n, hkv, K, K), "C": (n, hkv, K, V), "H": (n, hq, K, V)}
    raise ValueError(f"operator: expected one of hla2, ahla, hla3, got {operator!r}")


def _run(
    operator: str,
    q: object,
    k: object,
    v: object,
    *,
    log_decay: object,
    scale: object,
    initial_state: object,
    output_final_state: bool,
    cu_seqlens: object,
    sp: SequenceParallelism | None,
    chunk_size: object,
    normalize: bool = False,
    ridge: float = 0.0,
    eps: float = DEFAULT_EPS,
    precision: str = "auto",
    plan: object = None,
) -> tuple[torch.Tensor, tuple | None]:
    """Validate, then run :func:`compose` with the primitive as every stage."""
    x = validate.check_inputs(
        q, k, v, log_decay=log_decay, scale=scale, cu_seqlens=cu_seqlens, sp=sp,
        chunk_size=chunk_size, output_final_state=output_final_state, plan=plan,
    )
    normalize = validate.check_bool("normalize", normalize)
    ridge = validate.check_nonneg("ridge", ridge)
    eps = validate.check_nonneg("eps", eps)
    precision = resolve(precision, x.q.dtype, x.q.device)
    fields = state_fields(operator, x.n_seq, x.H, x.H, x.K, x.V, normalize)
    state0 = _unpack_state(initial_state, fields, x.q)
    call = None
    if sp is not None:
        # output_final_state decides whether the final states are all-reduced: agree on it.
        call = sp.check_call(x, op=operator, options=dict(
            normalize=normalize, ridge=ridge, eps=eps, output_final_state=output_final_state,
            initial_state=state0, precision=precision))
    cdt = stage_dtype(precision, x.q.dtype)

    def stage(qs: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, h0: torch.Tensor | None):
        # every stage of the call carries its one plan (one ordering of its collectives)
        return primitive(
            qs, kk, vv, x.g, cu_seqlens=x.plan, h0=h0, want_final=output_final_state,
            chunk_size=x.chunk_size, sp=sp, plan=call,
        )

    o, final = compose(
        operator, x.q.to(cdt) * x.scale, x.k.to(cdt), x.v.to(cdt), state0,
        shared=stage, per_head=stage, normalize=normalize, ridge=ridge, eps=eps,
    )
    state = STATE_TYPES[operator](*final) if output_final_state else None
    return o.to(x.q.dtype), state


def hla2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: torch.Tensor | None = None,
    normalize: bool = False,
    eps: float = DEFAULT_EPS,
    ridge: float = 0.0,
    scale: float | None = None,
    initial_state: HLA2State | tuple | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    sp: SequenceParallelism | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    precision: str = "auto",
    plan: BatchPlan | None = None,
) -> tuple[torch.Tensor, HLA2State | None]:
    """Masked second-order HLA: o_t = sum_{i<=j<=t} exp(A_t - A_i)(q_t.k_i)(k_i.q_j) v_j.

    Args:
        q, k: [B, T, H, K]. v: [B, T, H, V].
        normalize: divide by den_t = q_t^T eta_t (eps added). den can be negative or
            near zero: that is the paper's definition, kept as is.
        ridge: lambda of the paper's S + lambda I.
        initial_state: :class:`HLA2State` (eta required iff ``normalize``); S must be
            symmetric, as every S the operators return (a non-symmetric one is refused).
        precision: "auto" | "exact" | "fast": what the stages exchange for 16-bit
            inputs (:mod:`hla_sp.ops.precision`); auto is fast on CUDA, exact elsewhere.
        plan: the batch's :class:`~hla_sp.ops.sharding.BatchPlan` instead of
            ``cu_seqlens`` (no host read).
        Other keywords as in :func:`hla_sp.linear_attention`.

    Returns:
        (o [B, T, H, V], HLA2State or None)
    """
    return _run(
        "hla2", q, k, v, log_decay=log_decay, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, sp=sp,
        chunk_size=chunk_size, normalize=normalize, ridge=ridge, eps=eps, precision=precision,
        plan=plan,
    )


def ahla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: AHLAState | tuple | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    sp: SequenceParallelism | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    precision: str = "auto",
    plan: BatchPlan | None = None,
) -> tuple[torch.Tensor, AHLAState | None]:
    """Asymmetric HLA (AAV): o = ((W W) ⊙ L) V with W = L ⊙ QK^T, decay included.

    Keywords as in :func:`hla_sp.linear_attention` and ``precision`` as in
    :func:`hla2`; the state is :class:`AHLAState`.
    """
    return _run(
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
    initial_state: HLA3State | tuple | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    sp: SequenceParallelism | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    precision: str = "auto",
    plan: BatchPlan | None = None,
) -> tuple[torch.Tensor, HLA3State | None]:
    """Masked third-order HLA: o = (((W W^T) ⊙ L) W ⊙ L) V, middle index kept <= t.

    Keywords as in :func:`hla_sp.linear_attention` and ``precision`` as in
    :func:`hla2`; the state is :class:`HLA3State`.
    """
    return _run(
        "hla3", q, k, v, log_decay=log_decay, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, sp=sp,
        chunk_size=chunk_size, precision=precision, plan=plan,
    )

"""The operators' states and stages: compositions of the primitive.

    linear = LA(q, k, v)                         state (h,)
    hla2 = LA(q, LA(q, k, k), v)                 state (S, H[, eta])
    ahla = LA(q, k, LA(q, k, v))                 state (C, H)
    hla3 = LA(q, LA(q, k, k), LA(q, k, v))       state (S, C, H)
    ccq = LA(LA(q, k, k), k, v)                  state (S, h)

Every stage is one call of :func:`hla_sp.ops.primitive.primitive` (bound into a
:class:`StageContext` by the caller), so kernels, gradients and sequence parallelism
come from the primitive alone. The runner (:mod:`hla_sp.ops.runner`) calls them; the
operator table (:mod:`hla_sp.ops.table`) names them. What passes between the stages is
chosen by ``precision`` (:mod:`hla_sp.ops.dispatch`): the compute dtype (fp32, or
fp64), so that 16-bit inputs are rounded once at the output ("exact"), or the 16-bit
dtype itself, rounded once per stage ("fast", the default on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from hla_sp.ops.dispatch import LOW_PRECISION

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


class Stage(Protocol):
    """A stage: (q [B, T, Hq, K], keys, values, h0) -> (out, final state or None). The
    log-decay, documents, chunk size and sequence parallelism are bound in by the caller.
    ``scale``: the factor the kernels apply to q in this stage, if not the call's
    (:attr:`StageContext.scale`)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 h0: torch.Tensor | None, *,
                 scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]: ...


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
    ``scale``: the factor every stage's kernels multiply q by (q's fp32 products, no pass
    of its own); 1.0 when ``qs`` arrives scaled. A stage whose output is a query again
    runs at ``scale=1.0`` (ccq's S q), so that the stage reading it applies it once.
    """

    shared: Stage
    per_head: Stage
    expand: Callable[[torch.Tensor], torch.Tensor] = _same
    key_mix: torch.Tensor | None = None
    value_mix: torch.Tensor | None = None
    mix_norm: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)
    scale: float = 1.0

    def key(self, higher: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The outer stage's key [B, T, Hq, K]: k + a k~ with ``key_mix`` a, else k~."""
        return _mix(higher, self.key_mix, lambda: self.expand(k), self.mix_norm)

    def query(self, higher: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
        """The outer stage's query [B, T, Hq, K]: q + a q~ with ``key_mix`` a, else q~
        (``qs`` is already per query head, so nothing is expanded).

        With the scale s in the kernels, qs and q~ = S qs carry none, and the outer stage
        scales the whole query: right for q + a q~, but the unit norm (eps inside its
        root) is not blind to s: s q + a u(s q~) = s (q + (a/s) u(s q~)), one pass over q~
        as the scaled q was.
        """
        weight = self.key_mix
        if weight is not None and self.mix_norm and self.scale != 1.0:
            if self.scale == 0.0:  # the stage zeroes the query, and u(0 q~) is 0 anyway
                return qs
            higher, weight = higher * self.scale, weight / self.scale
        return _mix(higher, weight, lambda: qs, self.mix_norm)

    def value(self, higher: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The outer stage's value [B, T, Hq, V]: v + b u with ``value_mix`` b, else u."""
        return _mix(higher, self.value_mix, lambda: self.expand(v), self.mix_norm)


# The stages of each operator: (ctx, qs [B, T, Hq, K] scaled, or unscaled when the
# entry's ``scale_in_kernels`` says so and ``ctx.scale`` is the scale (the primitive
# calls of the stages then scale it in the kernels), k [B, T, Hkv, K],
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
        # k~ carries the scale that the kernels applied; qs may not
        k_tilde = torch.add(k_tilde, qs, alpha=ridge * ctx.scale)
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
    # q~_t = S_t q_t is a query again: its stage leaves q as it arrives, and the second
    # stage applies the scale once
    q_tilde, S = ctx.shared(qs, k, k, S0, scale=1.0)
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

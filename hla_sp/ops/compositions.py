"""The higher-order operators, each a composition of the primitive.

    hla2 = LA(q, LA(q, k, k), v)                 state (S, H[, eta])
    ahla = LA(q, k, LA(q, k, v))                 state (C, H)
    hla3 = LA(q, LA(q, k, k), LA(q, k, v))       state (S, C, H)

Every stage is one call of :func:`hla_sp.ops.linear_attention.primitive`, so kernels,
gradients and sequence parallelism come from the primitive alone. Intermediates
(k~ = S q, u = C^T q) stay in the compute dtype (fp32, or fp64) between stages so
that bf16 inputs are rounded once, at the output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from hla_sp.ops import validate
from hla_sp.ops.chunk import compute_dtype
from hla_sp.ops.linear_attention import DEFAULT_CHUNK_SIZE, primitive

if TYPE_CHECKING:
    from hla_sp.parallel import SequenceParallel

DEFAULT_EPS = 1e-6


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
    if state is None:
        return [None] * len(fields)
    names = list(fields)
    if not isinstance(state, (tuple, list)):
        raise TypeError(
            f"initial_state: expected a tuple or list ({', '.join(names)}), "
            f"got {type(state).__name__}"
        )
    want = [n for n in names if fields[n] is not None]
    given = list(state) + [None] * (len(names) - len(state))
    if len(state) > len(names) or any(given[names.index(n)] is None for n in want):
        raise ValueError(
            f"initial_state: expected the fields ({', '.join(want)}), got a tuple of "
            f"{len(state)} with None at "
            f"{[names[i] for i, x in enumerate(given) if x is None]}"
        )
    out = []
    for name, x in zip(names, given):
        shape = fields[name]
        if shape is None:
            if x is not None:
                raise ValueError(
                    f"initial_state.{name}: expected None for these options, got a tensor"
                )
            out.append(None)
        else:
            out.append(validate.check_state(f"initial_state.{name}", x, shape, q))
    return out


def _check_flag(name: str, x: object) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__}")
    return x


def _check_nonneg(name: str, x: object) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not x >= 0:
        raise ValueError(f"{name}: expected a float >= 0, got {x!r}")
    return float(x)


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
    sp: SequenceParallel | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, HLA2State | None]:
    """Masked second-order HLA: o_t = sum_{i<=j<=t} exp(A_t - A_i)(q_t.k_i)(k_i.q_j) v_j.

    Args:
        q, k: [B, T, H, K]. v: [B, T, H, V].
        normalize: divide by den_t = q_t^T eta_t (eps added). den can be negative or
            near zero: that is the paper's definition, kept as is.
        ridge: lambda of the paper's S + lambda I.
        initial_state: :class:`HLA2State` (eta required iff ``normalize``).
        Other keywords as in :func:`hla_sp.linear_attention`.

    Returns:
        (o [B, T, H, V], HLA2State or None)
    """
    x = validate.check_inputs(
        q,
        k,
        v,
        log_decay=log_decay,
        scale=scale,
        cu_seqlens=cu_seqlens,
        sp=sp,
        chunk_size=chunk_size,
    )
    normalize = _check_flag("normalize", normalize)
    ridge = _check_nonneg("ridge", ridge)
    eps = _check_nonneg("eps", eps)
    N, H, K, V = x.n_seq, x.H, x.K, x.V
    S0, H0, eta0 = _unpack_state(
        initial_state,
        {"S": (N, H, K, K), "H": (N, H, K, V), "eta": (N, H, K) if normalize else None},
        x.q,
    )
    if sp is not None:
        sp.check_call(x, op="hla2", options=(normalize, ridge, eps))
    cdt = compute_dtype(x.q.dtype)
    qs, kk, vv = (x.q * x.scale).to(cdt), x.k.to(cdt), x.v.to(cdt)
    common = dict(
        cu_seqlens=x.cu_seqlens, want_final=output_final_state, chunk_size=x.chunk_size, sp=sp
    )

    k_tilde, S = primitive(qs, kk, kk, x.g, h0=S0, **common)
    if ridge:
        k_tilde = k_tilde + ridge * qs
    if normalize:
        # den is the same primitive with a ones column appended to v.
        vv = torch.cat([vv, torch.ones_like(vv[..., :1])], dim=-1)
        if H0 is not None:
            H0 = torch.cat([H0, eta0[..., None]], dim=-1)
    o, Hf = primitive(qs, k_tilde, vv, x.g, h0=H0, **common)
    eta = None
    if normalize:
        o = o[..., :V] / (o[..., V:] + eps)
        if Hf is not None:
            Hf, eta = Hf[..., :V], Hf[..., V]
    state = HLA2State(S, Hf, eta) if output_final_state else None
    return o.to(x.q.dtype), state


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
    sp: SequenceParallel | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, AHLAState | None]:
    """Asymmetric HLA (AAV): o = ((W W) ⊙ L) V with W = L ⊙ QK^T, decay included.

    Keywords as in :func:`hla_sp.linear_attention`; the state is :class:`AHLAState`.
    """
    x = validate.check_inputs(
        q,
        k,
        v,
        log_decay=log_decay,
        scale=scale,
        cu_seqlens=cu_seqlens,
        sp=sp,
        chunk_size=chunk_size,
    )
    shape = (x.n_seq, x.H, x.K, x.V)
    C0, H0 = _unpack_state(initial_state, {"C": shape, "H": shape}, x.q)
    if sp is not None:
        sp.check_call(x, op="ahla", options=())
    cdt = compute_dtype(x.q.dtype)
    qs, kk, vv = (x.q * x.scale).to(cdt), x.k.to(cdt), x.v.to(cdt)
    common = dict(
        cu_seqlens=x.cu_seqlens, want_final=output_final_state, chunk_size=x.chunk_size, sp=sp
    )
    u, C = primitive(qs, kk, vv, x.g, h0=C0, **common)
    o, Hf = primitive(qs, kk, u, x.g, h0=H0, **common)
    return o.to(x.q.dtype), (AHLAState(C, Hf) if output_final_state else None)


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
    sp: SequenceParallel | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, HLA3State | None]:
    """Masked third-order HLA: o = (((W W^T) ⊙ L) W ⊙ L) V, middle index kept <= t.

    Keywords as in :func:`hla_sp.linear_attention`; the state is :class:`HLA3State`.
    """
    x = validate.check_inputs(
        q,
        k,
        v,
        log_decay=log_decay,
        scale=scale,
        cu_seqlens=cu_seqlens,
        sp=sp,
        chunk_size=chunk_size,
    )
    N, H, K, V = x.n_seq, x.H, x.K, x.V
    S0, C0, H0 = _unpack_state(
        initial_state, {"S": (N, H, K, K), "C": (N, H, K, V), "H": (N, H, K, V)}, x.q
    )
    if sp is not None:
        sp.check_call(x, op="hla3", options=())
    cdt = compute_dtype(x.q.dtype)
    qs, kk, vv = (x.q * x.scale).to(cdt), x.k.to(cdt), x.v.to(cdt)
    common = dict(
        cu_seqlens=x.cu_seqlens, want_final=output_final_state, chunk_size=x.chunk_size, sp=sp
    )
    k_tilde, S = primitive(qs, kk, kk, x.g, h0=S0, **common)
    u, C = primitive(qs, kk, vv, x.g, h0=C0, **common)
    o, Hf = primitive(qs, k_tilde, u, x.g, h0=H0, **common)
    return o.to(x.q.dtype), (HLA3State(S, C, Hf) if output_final_state else None)

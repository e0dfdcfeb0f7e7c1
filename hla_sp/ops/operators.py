"""The built-in operators: their public functions and their entries in the table.

Each public function is a documented call of the one runner
(:func:`hla_sp.ops.runner.run_operator`); each entry (:class:`OperatorSpec`, in the
leaf module :mod:`hla_sp.ops.table`) says what the operator is. The table's API is
re-exported here (``operators.register``, ``operators.OperatorSpec``, ...). Adding an
operator: docs/operators.md.
"""

from __future__ import annotations

import torch

from hla_sp.config import BUILTIN_OPERATORS
from hla_sp.ops import reference as R
from hla_sp.ops import stages as C
from hla_sp.ops.linear_attention import linear_attention
from hla_sp.ops.primitive import DEFAULT_CHUNK_SIZE
from hla_sp.ops.runner import run_operator
from hla_sp.ops.sharding import BatchPlan
from hla_sp.ops.sp_protocol import SequenceParallelism
from hla_sp.ops.table import (
    DEFAULT_EPS,
    OPTIONS,
    TABLE,
    Field,
    OperatorSpec,
    check_options,
    get,
    register,
    registered,
    state_fields,
    unregister,
)

__all__ = [
    "OPTIONS", "TABLE", "Field", "OperatorSpec", "ahla", "ccq", "check_options", "get",
    "hla2", "hla3", "register", "registered", "state_fields", "unregister",
]


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
            inputs (:mod:`hla_sp.ops.dispatch`); auto is fast on CUDA, exact elsewhere.
        plan: the batch's :class:`~hla_sp.ops.sharding.BatchPlan` instead of
            ``cu_seqlens`` (no host read).
        Other keywords as in :func:`hla_sp.linear_attention`.

    Returns:
        (o [B, T, H, V], C.HLA2State or None)
    """
    return run_operator(  # type: ignore[return-value]
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
    return run_operator(  # type: ignore[return-value]
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
    return run_operator(  # type: ignore[return-value]
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
    return run_operator(  # type: ignore[return-value]
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
    key_mix=True, options=("normalize", "eps", "ridge"), scale_in_kernels=True))
_builtin(OperatorSpec(
    "ahla", C.AHLAState, (_KV_C, _Q_H), C.ahla_stages,
    public=ahla, reference=R.recurrent_ahla, value_mix=True, scale_in_kernels=True))
_builtin(OperatorSpec(
    "hla3", C.HLA3State, (_KV_S, _KV_C, _Q_H), C.hla3_stages,
    public=hla3, reference=R.recurrent_hla3, key_mix=True, value_mix=True,
    scale_in_kernels=True))
_builtin(OperatorSpec(
    "ccq", C.CCQState, (_KV_S, Field("h", "kv", ("K", "V"))), C.ccq_stages,
    public=ccq, reference=R.recurrent_ccq, key_mix=True, scale_in_kernels=True))
_builtin(OperatorSpec(
    "linear", C.LinearState, (Field("h", "kv", ("K", "V")),), C.linear_stages,
    public=linear_attention, reference=R.recurrent_linear_attention, higher_order=False,
    precision=False, bare_state=True, scale_in_kernels=True))
if {n: s.facts() for n, s in TABLE.items()} != BUILTIN_OPERATORS:
    raise RuntimeError(
        "hla_sp.config.BUILTIN_OPERATORS differs from the operator table: "
        f"{BUILTIN_OPERATORS} against {({n: s.facts() for n, s in TABLE.items()})}")

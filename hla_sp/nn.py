"""The HLA attention layer: projections, GQA, decay, norms, streaming decode.

Two modules:

* :class:`HLAHeads` works on per-head q, k, v. It holds everything a plain PyTorch
  layer and Megatron's core-attention slot have in common: the L2 qk-norm, the
  decay (none, fixed, learned or data-dependent), the operator call (with the key
  moment S shared by the heads of a GQA group), and the per-head output RMSNorm.
  :class:`hla_sp.megatron_patch.HLACoreAttention` wraps it; nothing is written twice.
* :class:`HLAttention` adds the q/k/v/o projections and the decode API
  (:meth:`HLAttention.init_state`, :meth:`HLAttention.step`).

GQA. With ``num_kv_heads < num_heads`` the query heads ``g * G .. g * G + G - 1`` share
kv head ``g`` (G = num_heads // num_kv_heads, Megatron's order). Every first-order
stage whose key and value are both kv-head tensors (S = sum k k^T of hla2/hla3,
C = sum k v^T of ahla/hla3, the state of ``linear``) then has ONE state per group:
the stage runs on the kv heads, and each query head reads it (k~ = S q). Through the
primitive this is exact: each token t becomes G sub-tokens, the first carrying k_t
(and the decay), the others k = 0 and no decay, so the state does not move while the
G query heads of the group read it in turn. The stages whose key or value depends on
the query (H of hla2, ahla, hla3) run per query head.

Decay lives per kv head, so that a group's shared state is well defined; with
``num_kv_heads == num_heads`` that is per head.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hla_sp.ops import validate
from hla_sp.ops.chunk import compute_dtype
from hla_sp.ops.compositions import (
    DEFAULT_EPS,
    STATE_TYPES,
    ahla,
    compose,
    hla2,
    hla3,
    state_fields,
)
from hla_sp.ops.linear_attention import DEFAULT_CHUNK_SIZE, linear_attention, primitive

if TYPE_CHECKING:
    from hla_sp.parallel import SequenceParallel

OPERATORS = ("hla2", "ahla", "hla3", "linear")
DECAYS = ("none", "fixed", "learned", "data")

# Defaults (docs/layer.md says why): stable at long context without tuning.
DEFAULT_OPERATOR = "hla2"
DEFAULT_DECAY = "learned"
# RetNet's schedule: gamma_h = 1 - 2^-(5 + ...) spread over [2^-5, 2^-12], i.e. memory
# windows of about 32 to 4096 tokens.
RETNET_LOG2_RANGE = (5.0, 12.0)
# GLA divides its log-sigmoid gate by 16 so that per-token decays start close to 1.
DATA_DECAY_TEMPERATURE = 16.0


class LinearState(NamedTuple):
    """State of ``linear``: h [N, Hkv, K, V] (shared by a GQA group)."""

    h: torch.Tensor


def retnet_log_decay(num_heads: int, device: torch.device | None = None) -> torch.Tensor:
    """Per-head log-decay log(1 - 2^-e_h), e_h evenly spaced over RETNET_LOG2_RANGE. [H] fp32."""
    lo, hi = RETNET_LOG2_RANGE
    if num_heads == 1:
        e = torch.tensor([lo], dtype=torch.float64)
    else:
        e = torch.linspace(lo, hi, num_heads, dtype=torch.float64)
    # log1p keeps the tiny rates exact (log(1 - 2^-12) in fp32 would round).
    return torch.log1p(-torch.exp2(-e)).to(torch.float32).to(device)


# --------------------------------------------------------------------------------------
# The operators with GQA: shared first-order stages, through the primitive.
# --------------------------------------------------------------------------------------


def _interleave(x: torch.Tensor, groups: int, *, repeat: bool) -> torch.Tensor:
    """[B, T, Hkv, *D] -> [B, T * G, Hkv, *D]: sub-token (t, j) at t * G + j.

    ``repeat``: every sub-token gets x_t (queries of the group, after a reshape by the
    caller); otherwise sub-token 0 gets x_t and the others zero (keys, values, decay).
    """
    B, T = x.shape[:2]
    x = x.unsqueeze(2)
    if repeat:
        x = x.expand(B, T, groups, *x.shape[3:])
    else:
        x = torch.cat([x, x.new_zeros(B, T, groups - 1, *x.shape[3:])], dim=2)
    return x.reshape(B, T * groups, *x.shape[3:])


def shared_stage(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    *,
    h0: torch.Tensor | None,
    want_final: bool,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int,
    sp: SequenceParallel | None,
    plan: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One primitive stage whose state is shared by each GQA group.

    Under ``sp`` the interleaved shard is planned (one agreement check) when ``plan``;
    consecutive shared stages of one call pass ``plan=False`` after the first, so their
    exchanges share one backward ordering chain.

    Args:
        q: [B, T, Hq, K] scaled queries, Hq = G * Hkv (query head h reads kv head h // G).
        k: [B, T, Hkv, K]. v: [B, T, Hkv, V]. g: [B, T, Hkv] log-decay or None.
        h0: [N, Hkv, K, V] or None. cu_seqlens: global offsets (tokens), or None.

    Returns:
        o [B, T, Hq, V] with o[:, t, h] = q[:, t, h]^T h_t[h // G], and the final state
        [N, Hkv, K, V] or None.
    """
    B, T, Hq, K = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    if G == 1:
        return primitive(q, k, v, g, cu_seqlens=cu_seqlens, h0=h0, want_final=want_final,
                         chunk_size=chunk_size, sp=sp)
    # [B, T, Hkv, G, K] -> [B, T, G, Hkv, K] -> [B, T*G, Hkv, K]: sub-token j reads head j.
    qi = q.view(B, T, Hkv, G, K).transpose(2, 3).reshape(B, T * G, Hkv, K)
    ki = _interleave(k, G, repeat=False)
    vi = _interleave(v, G, repeat=False)
    gi = None if g is None else _interleave(g, G, repeat=False)
    cu = None if cu_seqlens is None else cu_seqlens * G
    if sp is not None and plan:
        # The interleaved shard is a call of its own (local T * G, offsets * G): every
        # rank checks and plans it, as a public operator does before its stages.
        xi = validate.check_inputs(qi, ki, vi, log_decay=gi, scale=1.0, cu_seqlens=cu, sp=sp,
                                   chunk_size=chunk_size)
        sp.check_call(xi, op=f"gqa-shared-stage/{G}", options=())
    o, final = primitive(qi, ki, vi, gi, cu_seqlens=cu, h0=h0, want_final=want_final,
                         chunk_size=chunk_size, sp=sp)
    V = v.shape[-1]
    o = o.view(B, T, G, Hkv, V).transpose(2, 3).reshape(B, T, Hq, V)
    return o, final


def _state_shapes(
    operator: str, n: int, hq: int, hkv: int, k: int, v: int, normalize: bool
) -> dict[str, tuple[int, ...] | None]:
    if operator == "linear":
        return {"h": (n, hkv, k, v)}
    return state_fields(operator, n, hq, hkv, k, v, normalize)


_STATE_TYPES = {**STATE_TYPES, "linear": LinearState}


def grouped_operator(
    operator: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: torch.Tensor | None = None,
    normalize: bool = False,
    eps: float = DEFAULT_EPS,
    ridge: float = 0.0,
    scale: float | None = None,
    initial_state: tuple | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    sp: SequenceParallel | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, tuple | None]:
    """An HLA operator with grouped keys and values (GQA/MQA), exact.

    Args:
        operator: "hla2" | "ahla" | "hla3" | "linear".
        q: [B, T, Hq, K]. k: [B, T, Hkv, K]. v: [B, T, Hkv, V], Hq a multiple of Hkv.
        log_decay: broadcasts to [B, T, Hkv] (values <= 0); one decay per group.
        initial_state: the operator's state with the shared fields (S, C, h) over Hkv
            heads and the per-query-head fields (H, eta) over Hq heads.
        Other keywords as in :func:`hla_sp.hla2`.

    Returns:
        (o [B, T, Hq, V], state or None). With Hq == Hkv this is exactly the public
        operator (it is called).
    """
    operator = validate.check_choice("operator", operator, OPERATORS)
    for name, x in (("q", q), ("k", k), ("v", v)):
        validate.check_tensor(name, x, 4, "[B, T, H, D]")
    B, T, Hq, K = q.shape
    Hkv = k.shape[2]
    if k.shape[:2] != q.shape[:2] or k.shape[3] != K:
        raise ValueError(f"k: expected shape [B, T, Hkv, K] = [{B}, {T}, Hkv, {K}], "
                         f"got {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v: expected leading dims {tuple(k.shape[:3])} (those of k), "
                         f"got {tuple(v.shape[:3])}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"k: expected a number of kv heads dividing Hq = {Hq}, got {Hkv}")
    if Hq == Hkv:
        fn = {"hla2": hla2, "ahla": ahla, "hla3": hla3}.get(operator)
        kw: dict = dict(log_decay=log_decay, scale=scale, initial_state=initial_state,
                        output_final_state=output_final_state, cu_seqlens=cu_seqlens, sp=sp,
                        chunk_size=chunk_size)
        if fn is None:
            if initial_state is not None:
                kw["initial_state"] = _unpack_one(initial_state)
            o, h = linear_attention(q, k, v, **kw)
            return o, (LinearState(h) if h is not None else None)
        if operator == "hla2":
            kw.update(normalize=normalize, eps=eps, ridge=ridge)
        return fn(q, k, v, **kw)

    # Validate as the public operators do, on the kv-head view (decay is per group).
    x = validate.check_inputs(
        q[:, :, ::Hq // Hkv], k, v, log_decay=log_decay, scale=scale, cu_seqlens=cu_seqlens,
        sp=sp, chunk_size=chunk_size,
    )
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{name}: expected dtype {q.dtype} on {q.device} (those of q), "
                            f"got {t.dtype} on {t.device}")
    N, V = x.n_seq, v.shape[-1]
    fields = _state_shapes(operator, N, Hq, Hkv, K, V, normalize)
    from hla_sp.ops.compositions import _unpack_state

    s0 = _unpack_state(initial_state, fields, q)
    x_check = x  # the kv-view call, re-checked before each per-query-head stage under sp
    G = Hq // Hkv
    cdt = compute_dtype(q.dtype)
    qs, kk, vv = (q * x.scale).to(cdt), k.to(cdt), v.to(cdt)
    g = x.g
    gq = None if g is None else g.repeat_interleave(G, dim=-1)  # per query head
    common = dict(cu_seqlens=x.cu_seqlens, want_final=output_final_state,
                  chunk_size=x.chunk_size, sp=sp)

    planned = []  # every shared stage precedes the per-head stage: plan them once

    def shared(qq: torch.Tensor, kq: torch.Tensor, vq: torch.Tensor, h0: torch.Tensor | None):
        out = shared_stage(qq, kq, vq, g, h0=h0, plan=not planned, **common)
        planned.append(True)
        return out

    def per_head(qq: torch.Tensor, kq: torch.Tensor, vq: torch.Tensor, h0: torch.Tensor | None):
        if sp is not None:
            # shared_stage planned the interleaved shape; plan this one again.
            sp.check_call(x_check, op=f"{operator}/gqa{G}", options=(normalize, ridge, eps))
        return primitive(qq, kq, vq, gq, h0=h0, **common)

    if operator == "linear":
        o, h = shared(qs, kk, vv, s0[0])
        state: tuple = LinearState(h)
    else:
        o, final = compose(
            operator, qs, kk, vv, s0, shared=shared, per_head=per_head,
            expand=lambda t: t.repeat_interleave(G, dim=2),
            normalize=normalize, ridge=ridge, eps=eps,
        )
        state = _STATE_TYPES[operator](*final)
    return o.to(q.dtype), (state if output_final_state else None)


def _unpack_one(state: object) -> object:
    """The ``linear`` state may be given as LinearState(h), a 1-tuple or a bare tensor."""
    if isinstance(state, (tuple, list)):
        if len(state) != 1:
            raise ValueError(f"initial_state: expected (h,) for operator 'linear', "
                             f"got a tuple of {len(state)}")
        return state[0]
    return state


# --------------------------------------------------------------------------------------
# The shared per-head module.
# --------------------------------------------------------------------------------------


class HLAHeads(nn.Module):
    """Everything between per-head q, k, v and the per-head output.

    L2 qk-norm, decay, the operator (GQA-shared states), per-head output RMSNorm.
    Used by :class:`HLAttention` and by Megatron's ``HLACoreAttention``.

    Args:
        num_heads: query heads Hq (on this tensor-parallel rank).
        num_kv_heads: key/value heads Hkv, dividing Hq.
        head_dim: K = V, the per-head width.
        operator: "hla2" | "ahla" | "hla3" | "linear".
        decay: "none" | "fixed" (RetNet schedule per kv head) | "learned" (a per-kv-head
            parameter, initialised at the RetNet schedule) | "data" (per token:
            logsigmoid(w_h . k_t + b_h) / 16 from the kv head's key, GLA-like).
        qk_norm: L2-normalise q and k per head (before the scale).
        output_norm: RMSNorm over each head's output, with a learned gain per channel.
        normalize, eps, ridge: hla2's options (docs of :func:`hla_sp.hla2`).
        scale: query scale; None means K ** -0.5.
        chunk_size: chunk length of the chunk-parallel path.
        head_offset: global index of the first kv head (tensor parallelism), so the
            fixed schedule does not restart on every rank.
        total_kv_heads: kv heads over all ranks (the schedule's length); default Hkv.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int | None,
        head_dim: int,
        *,
        operator: str = DEFAULT_OPERATOR,
        decay: str = DEFAULT_DECAY,
        qk_norm: bool = True,
        output_norm: bool = True,
        normalize: bool = False,
        eps: float = DEFAULT_EPS,
        ridge: float = 0.0,
        scale: float | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        norm_eps: float = 1e-5,
        head_offset: int = 0,
        total_kv_heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.num_heads = validate.check_pos_int("num_heads", num_heads)
        kv = num_heads if num_kv_heads is None else num_kv_heads
        self.num_kv_heads = validate.check_pos_int("num_kv_heads", kv)
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: expected a divisor of num_heads = {num_heads}, "
                             f"got {self.num_kv_heads}")
        self.head_dim = validate.check_pos_int("head_dim", head_dim)
        self.operator = validate.check_choice("operator", operator, OPERATORS)
        self.decay = validate.check_choice("decay", decay, DECAYS)
        self.qk_norm = validate.check_bool("qk_norm", qk_norm)
        self.output_norm = validate.check_bool("output_norm", output_norm)
        self.normalize = validate.check_bool("normalize", normalize)
        if self.normalize and operator != "hla2":
            raise ValueError(f"normalize: only operator 'hla2' has it, got operator {operator!r}")
        self.eps = validate.check_nonneg("eps", eps)
        self.ridge = validate.check_nonneg("ridge", ridge)
        if self.ridge and operator != "hla2":
            raise ValueError(f"ridge: only operator 'hla2' has it, got operator {operator!r}")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
            raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
        self.scale = None if scale is None else float(scale)
        self.chunk_size = validate.check_chunk_size(chunk_size)
        self.norm_eps = validate.check_nonneg("norm_eps", norm_eps)
        self.head_offset = head_offset
        self.total_kv_heads = self.num_kv_heads if total_kv_heads is None else total_kv_heads
        if not 0 <= head_offset <= self.total_kv_heads - self.num_kv_heads:
            raise ValueError(f"head_offset: expected 0 <= head_offset <= total_kv_heads - "
                             f"num_kv_heads = {self.total_kv_heads - self.num_kv_heads}, "
                             f"got {head_offset}")
        fk = dict(device=device, dtype=dtype)
        Hkv, K = self.num_kv_heads, self.head_dim
        if self.decay in ("learned", "data"):
            # logsigmoid(p) = log(gamma): p = logit(gamma) puts the start on the RetNet
            # schedule, and log-decay <= 0 holds for every value of p by construction.
            self.decay_bias = nn.Parameter(torch.empty(Hkv, **fk))
        else:
            self.register_parameter("decay_bias", None)
        if self.decay == "data":
            self.decay_weight = nn.Parameter(torch.empty(Hkv, K, **fk))
        else:
            self.register_parameter("decay_weight", None)
        if self.output_norm:
            self.norm_weight = nn.Parameter(torch.empty(self.num_heads, K, **fk))
        else:
            self.register_parameter("norm_weight", None)
        self.reset_parameters()

    def _schedule(self, device: torch.device | None = None) -> torch.Tensor:
        """This rank's slice of the RetNet schedule, [Hkv] fp32."""
        full = retnet_log_decay(self.total_kv_heads, device)
        return full[self.head_offset : self.head_offset + self.num_kv_heads]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Decay at the RetNet schedule (data gate weight zero), norm gains one."""
        if self.decay_bias is not None:
            a = self._schedule(self.decay_bias.device).double()
            # logit(exp(a)) = a - log(1 - exp(a)) = a - log(-expm1(a))
            self.decay_bias.copy_(a - torch.log(-torch.expm1(a)))
        if self.decay_weight is not None:
            self.decay_weight.zero_()
        if self.norm_weight is not None:
            self.norm_weight.fill_(1.0)

    def log_decay(self, k: torch.Tensor) -> torch.Tensor | None:
        """The log-decay for keys k [B, T, Hkv, K]: None, [Hkv] or [B, T, Hkv] (<= 0).

        In the compute dtype (fp32, fp64 for fp64 keys)."""
        if self.decay == "none":
            return None
        if self.decay == "fixed":
            return self._schedule(k.device).to(compute_dtype(k.dtype))
        cdt = compute_dtype(k.dtype)
        if self.decay == "learned":
            return F.logsigmoid(self.decay_bias.to(cdt))
        z = torch.einsum("bthk,hk->bth", k.to(cdt), self.decay_weight.to(cdt))
        return F.logsigmoid(z + self.decay_bias.to(cdt)) / DATA_DECAY_TEMPERATURE

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"operator={self.operator}, decay={self.decay}, qk_norm={self.qk_norm}, "
                f"output_norm={self.output_norm}, normalize={self.normalize}, ridge={self.ridge}")

    def state_shapes(self, n: int) -> dict[str, tuple[int, ...] | None]:
        """Field -> shape of the operator's state for n sequences (None: absent)."""
        return _state_shapes(self.operator, n, self.num_heads, self.num_kv_heads,
                             self.head_dim, self.head_dim, self.normalize)

    def init_state(self, n: int, device: torch.device | str | None = None,
                   dtype: torch.dtype = torch.float32) -> tuple:
        """A zero state for n sequences (fp32: states accumulate in fp32)."""
        shapes = self.state_shapes(n)
        fields = [None if s is None else torch.zeros(s, device=device, dtype=dtype)
                  for s in shapes.values()]
        return _STATE_TYPES[self.operator](*fields)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        initial_state: tuple | None = None,
        output_final_state: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        sp: SequenceParallel | None = None,
        chunk_size: int | None = None,
    ) -> tuple[torch.Tensor, tuple | None]:
        """Per-head attention.

        Args:
            q: [B, T, Hq, K]. k, v: [B, T, Hkv, K]. Under ``sp`` each rank passes its
                shard and ``cu_seqlens`` holds global offsets.
            chunk_size: overrides the module's chunk length (decode steps use 1).

        Returns:
            (o [B, T, Hq, K] in q's dtype, final state or None)
        """
        if q.dim() != 4 or q.shape[2:] != (self.num_heads, self.head_dim):
            raise ValueError(f"q: expected [B, T, {self.num_heads}, {self.head_dim}], "
                             f"got {tuple(q.shape)}")
        for name, x in (("k", k), ("v", v)):
            if x.dim() != 4 or x.shape[2:] != (self.num_kv_heads, self.head_dim):
                raise ValueError(f"{name}: expected [B, T, {self.num_kv_heads}, "
                                 f"{self.head_dim}], got {tuple(x.shape)}")
        log_decay = self.log_decay(k)
        for name, x in (("k", k), ("v", v)):
            if x.dtype != q.dtype:
                raise TypeError(f"{name}: expected dtype {q.dtype} (the dtype of q), "
                                f"got {x.dtype}")
        # Everything between the projections runs in the compute dtype (fp32, or fp64
        # for fp64 inputs) and is rounded once, at the output: the operators accumulate
        # in it anyway, and normalised q, k are not rounded back to bf16 first.
        in_dtype = q.dtype
        cdt = compute_dtype(in_dtype)
        q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
        if self.qk_norm:
            # L2 per head: |q.k| <= 1, so no power of t in S, H can come from key size.
            q = F.normalize(q, dim=-1)
            k = F.normalize(k, dim=-1)
        o, state = grouped_operator(
            self.operator, q, k, v, log_decay=log_decay, normalize=self.normalize,
            eps=self.eps, ridge=self.ridge, scale=self.scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens, sp=sp,
            chunk_size=self.chunk_size if chunk_size is None else chunk_size,
        )
        if self.output_norm:
            # Per-head RMSNorm: HLA outputs grow with context (a power of t without
            # decay) and with the head's window; the norm removes the scale, the gain
            # learns it back.
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps)
            o = o * self.norm_weight.to(cdt)
        return o.to(in_dtype), state
        return o, state


# --------------------------------------------------------------------------------------
# The layer.
# --------------------------------------------------------------------------------------


class HLAttention(nn.Module):
    """Higher-order linear attention layer for a plain PyTorch model.

    x [B, T, hidden] -> q, k, v projections -> :class:`HLAHeads` -> output projection.

    Args:
        hidden_size: model width D.
        num_heads: query heads Hq.
        head_dim: per-head width K (= V); default hidden_size // num_heads.
        num_kv_heads: key/value heads (GQA/MQA); default num_heads.
        operator, decay, qk_norm, output_norm, normalize, eps, ridge, scale, chunk_size:
            as in :class:`HLAHeads`.
        bias: biases in the projections.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int | None = None,
        num_kv_heads: int | None = None,
        *,
        operator: str = DEFAULT_OPERATOR,
        decay: str = DEFAULT_DECAY,
        qk_norm: bool = True,
        output_norm: bool = True,
        normalize: bool = False,
        eps: float = DEFAULT_EPS,
        ridge: float = 0.0,
        scale: float | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.hidden_size = validate.check_pos_int("hidden_size", hidden_size)
        validate.check_pos_int("num_heads", num_heads)
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"head_dim: needed, as num_heads = {num_heads} does not "
                                 f"divide hidden_size = {hidden_size}")
            head_dim = hidden_size // num_heads
        self.heads = HLAHeads(
            num_heads, num_kv_heads, head_dim, operator=operator, decay=decay, qk_norm=qk_norm,
            output_norm=output_norm, normalize=normalize, eps=eps, ridge=ridge, scale=scale,
            chunk_size=chunk_size, device=device, dtype=dtype,
        )
        Hq, Hkv, K = self.heads.num_heads, self.heads.num_kv_heads, self.heads.head_dim
        fk = dict(bias=bias, device=device, dtype=dtype)
        self.q_proj = nn.Linear(hidden_size, Hq * K, **fk)
        self.k_proj = nn.Linear(hidden_size, Hkv * K, **fk)
        self.v_proj = nn.Linear(hidden_size, Hkv * K, **fk)
        self.o_proj = nn.Linear(Hq * K, hidden_size, **fk)

    @property
    def operator(self) -> str:
        return self.heads.operator

    def forward(
        self,
        x: torch.Tensor,
        *,
        initial_state: tuple | None = None,
        output_final_state: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        sp: SequenceParallel | None = None,
        chunk_size: int | None = None,
    ) -> tuple[torch.Tensor, tuple | None]:
        """x [B, T, hidden] -> (y [B, T, hidden], final state or None).

        ``cu_seqlens`` (B == 1) packs documents; ``sp`` runs sequence parallelism
        (each rank passes its shard); ``initial_state`` continues from a state of
        :meth:`init_state` / a previous call.
        """
        validate.check_tensor("x", x, 3, "[B, T, hidden]")
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected last dim hidden_size = {self.hidden_size}, "
                             f"got {x.shape[-1]}")
        B, T, _ = x.shape
        h = self.heads
        q = self.q_proj(x).view(B, T, h.num_heads, h.head_dim)
        k = self.k_proj(x).view(B, T, h.num_kv_heads, h.head_dim)
        v = self.v_proj(x).view(B, T, h.num_kv_heads, h.head_dim)
        o, state = h(q, k, v, initial_state=initial_state, output_final_state=output_final_state,
                     cu_seqlens=cu_seqlens, sp=sp, chunk_size=chunk_size)
        # Explicit width: an empty shard (T = 0 under sp) cannot infer a -1.
        return self.o_proj(o.reshape(B, T, h.num_heads * h.head_dim)), state

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> tuple:
        """A zero decode state for ``batch_size`` sequences (the operator's state tuple)."""
        validate.check_pos_int("batch_size", batch_size)
        if device is None:
            device = self.q_proj.weight.device
        return self.heads.init_state(batch_size, device=device)

    def step(self, x_t: torch.Tensor, state: tuple) -> tuple[torch.Tensor, tuple]:
        """One decode step, O(1) in the context length.

        Args:
            x_t: [B, hidden] (or [B, 1, hidden]) the next token's input.
            state: from :meth:`init_state`, a previous step, or a forward with
                ``output_final_state=True`` (prefill).

        Returns:
            (y_t of x_t's shape, the new state)
        """
        if not isinstance(x_t, torch.Tensor):
            raise TypeError(f"x_t: expected a torch.Tensor, got {type(x_t).__name__}")
        squeeze = x_t.dim() == 2
        x = x_t.unsqueeze(1) if squeeze else x_t
        if x.dim() != 3 or x.shape[1] != 1:
            raise ValueError(f"x_t: expected [B, hidden] or [B, 1, hidden], got {tuple(x_t.shape)}")
        if state is None:
            raise ValueError("state: expected a state tuple (see init_state), got None")
        # One token: the operator's recurrent update with the state as carry-in. With
        # T = 1 a chunk of 1 avoids padding to the training chunk length (G sub-tokens
        # under GQA fit in one chunk of the next power of two).
        G = self.heads.num_heads // self.heads.num_kv_heads
        chunk = 1 << max(0, math.ceil(math.log2(G)))
        y, new = self.forward(x, initial_state=state, output_final_state=True, chunk_size=chunk)
        return (y.squeeze(1) if squeeze else y), new

"""The per-head part of HLA attention, shared by the plain layer and Megatron.

:class:`HLAHeads` takes per-head q, k, v and returns the per-head output: the L2
qk-norm, the decay (none, fixed, learned or data-dependent), the operator (with the key
moment S shared by the heads of a GQA group), the first-order path and the per-head
output RMSNorm. ``hla_sp.megatron_patch.HLACoreAttention`` wraps it, so nothing is
written twice. Its options and their defaults are those of :class:`hla_sp.config.HLAConfig`.

The first-order path (``first_order``, on by default) is what makes the higher-order
operators learn (docs/quality.md): the outer stage reads k + a k~ (hla2, hla3) and
v + b u (ahla, hla3), with a, b learned per query head and zero at the start, so the
layer starts as first-order linear attention and grows its higher-order terms as far
as they help. Without it, hla2/ahla/hla3 stay at chance on associative recall.

Decay lives per kv head, so that a group's shared state is well defined; with
``num_kv_heads == num_heads`` that is per head.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hla_sp.config import DECAYS, PRECISIONS, HLAConfig, operator_names
from hla_sp.nn.conv import ShortConv
from hla_sp.ops import operators, validate
from hla_sp.ops.dispatch import compute_dtype, resolve, stage_dtype
from hla_sp.ops.runner import execute
from hla_sp.ops.sharding import BatchPlan
from hla_sp.ops.sp_protocol import SequenceParallelism

DEFAULTS = HLAConfig()
HEADS_OPTIONS = tuple(DEFAULTS.heads_kwargs())  # the HLA options the layers take
# RetNet's schedule: gamma_h = 1 - 2^-(5 + ...) spread over [2^-5, 2^-12], i.e. memory
# windows of about 32 to 4096 tokens.
RETNET_LOG2_RANGE = (5.0, 12.0)
# GLA divides its log-sigmoid gate by 16 so that per-token decays start close to 1.
DATA_DECAY_TEMPERATURE = 16.0


class LayerState(NamedTuple):
    """The state of a layer with a short convolution: the operator's state tuple and the
    convolution's last W-1 inputs per sequence, conv [N, W-1, (Hq + 2 Hkv) K] (q, k, v
    side by side, before the convolution)."""

    op: tuple
    conv: torch.Tensor


def retnet_log_decay(num_heads: int, device: torch.device | None = None) -> torch.Tensor:
    """Per-head log-decay log(1 - 2^-e_h), e_h evenly spaced over RETNET_LOG2_RANGE. [H] fp32."""
    lo, hi = RETNET_LOG2_RANGE
    if num_heads == 1:
        e = torch.tensor([lo], dtype=torch.float64)
    else:
        e = torch.linspace(lo, hi, num_heads, dtype=torch.float64)
    # log1p keeps the tiny rates exact (log(1 - 2^-12) in fp32 would round).
    return torch.log1p(-torch.exp2(-e)).to(torch.float32).to(device)


class HLAHeads(nn.Module):
    """Everything between per-head q, k, v and the per-head output.

    Args:
        num_heads: query heads Hq (on this tensor-parallel rank).
        num_kv_heads: key/value heads Hkv, dividing Hq (None: Hq).
        head_dim: K = V, the per-head width.
        operator: "hla2" | "ahla" | "hla3" | "linear", or an operator registered on
            the table (:mod:`hla_sp.ops.operators`).
        decay: "none" | "fixed" (RetNet schedule per kv head) | "learned" (a per-kv-head
            parameter, initialised at the RetNet schedule) | "data" (per token:
            logsigmoid(w_h . k_t + b_h) / 16 from the kv head's key, GLA-like).
        qk_norm: L2-normalise q and k per head (before the scale).
        output_norm: RMSNorm over each head's output, with a learned gain per channel.
        first_order: the first-order path with learned per-head weights (module docs).
        mix_norm: with the first-order path, unit-normalise the mixed-in k~ and u per
            token, so that a and b weigh terms whose size does not grow with t.
        short_conv: taps of the causal depthwise convolution (SiLU) on q, k, v; 0: none.
            With it the state is a :class:`LayerState`.
        normalize, eps, ridge: hla2's options (docs of :func:`hla_sp.hla2`).
        scale: query scale; None means K ** -0.5.
        chunk_size: chunk length of the chunk-parallel path.
        precision: "auto" | "exact" | "fast": what the operator's stages exchange for
            16-bit inputs (:mod:`hla_sp.ops.dispatch`; auto is fast on CUDA).
        head_offset: global index of the first kv head (tensor parallelism), so the
            fixed schedule does not restart on every rank.
        total_kv_heads: kv heads over all ranks (the schedule's length); default Hkv.
        config: an :class:`hla_sp.config.HLAConfig` that holds the options above, whole
            (then none of them is passed).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int | None,
        head_dim: int,
        *,
        operator: str = DEFAULTS.operator,
        decay: str = DEFAULTS.decay,
        qk_norm: bool = DEFAULTS.qk_norm,
        output_norm: bool = DEFAULTS.output_norm,
        first_order: bool = DEFAULTS.first_order,
        mix_norm: bool = DEFAULTS.mix_norm,
        short_conv: int = DEFAULTS.short_conv,
        normalize: bool = DEFAULTS.normalize,
        eps: float = DEFAULTS.eps,
        ridge: float = DEFAULTS.ridge,
        scale: float | None = DEFAULTS.scale,
        chunk_size: int = DEFAULTS.chunk_size,
        precision: str = DEFAULTS.precision,
        config: HLAConfig | None = None,
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
        # One set of choices and checks: the config's (given whole, or built here).
        given = {"operator": operator, "decay": decay, "qk_norm": qk_norm,
                 "output_norm": output_norm, "first_order": first_order, "mix_norm": mix_norm,
                 "short_conv": short_conv, "normalize": normalize, "eps": eps, "ridge": ridge,
                 "scale": scale, "chunk_size": chunk_size, "precision": precision}
        if config is not None:
            if not isinstance(config, HLAConfig):
                raise TypeError(f"config: expected an HLAConfig, got {type(config).__name__}")
            set_too = sorted(k for k, v in given.items() if v != getattr(DEFAULTS, k))
            if set_too:
                raise TypeError(f"config: expected no other HLA option beside it, got {set_too}")
        self.config = config if config is not None else HLAConfig(
            operator=validate.check_choice("operator", operator, operator_names()),
            decay=validate.check_choice("decay", decay, DECAYS),  # type: ignore[arg-type]
            qk_norm=qk_norm, output_norm=output_norm, first_order=first_order,
            mix_norm=mix_norm, short_conv=short_conv, normalize=normalize, eps=eps,
            ridge=ridge, scale=scale, chunk_size=chunk_size,
            precision=validate.check_choice("precision", precision, PRECISIONS),  # type: ignore[arg-type]
        )
        c = self.config
        self.operator, self.decay, self.qk_norm = c.operator, c.decay, c.qk_norm
        self.output_norm, self.first_order = c.output_norm, c.first_order
        self.mix_norm = c.mix_norm
        self.normalize, self.short_conv = c.normalize, c.short_conv
        self.eps, self.ridge, self.chunk_size = float(c.eps), float(c.ridge), c.chunk_size
        self.scale = None if c.scale is None else float(c.scale)
        self.precision = c.precision
        self.norm_eps = validate.check_nonneg("norm_eps", norm_eps)
        self.head_offset = head_offset
        self.total_kv_heads = self.num_kv_heads if total_kv_heads is None else total_kv_heads
        if not 0 <= head_offset <= self.total_kv_heads - self.num_kv_heads:
            raise ValueError(f"head_offset: expected 0 <= head_offset <= total_kv_heads - "
                             f"num_kv_heads = {self.total_kv_heads - self.num_kv_heads}, "
                             f"got {head_offset}")
        fk = dict(device=device, dtype=dtype)
        Hq, Hkv, K = self.num_heads, self.num_kv_heads, self.head_dim

        def param(shape: tuple[int, ...], on: bool) -> nn.Parameter | None:
            return nn.Parameter(torch.empty(*shape, **fk)) if on else None

        # logsigmoid(p) = log(gamma): p = logit(gamma) puts the start on the RetNet
        # schedule, and log-decay <= 0 holds for every value of p by construction.
        self.decay_bias = param((Hkv,), self.decay in ("learned", "data"))
        self.decay_weight = param((Hkv, K), self.decay == "data")
        self.norm_weight = param((Hq, K), self.output_norm)
        # The first-order path's weights, for the inputs the operator's outer stage mixes.
        spec = operators.get(self.operator)
        # The operator's own options, checked once here (every call reuses them).
        self._options = operators.check_options(
            spec, dict(normalize=self.normalize, eps=self.eps, ridge=self.ridge))
        self.key_mix = param((Hq,), self.first_order and spec.key_mix)
        self.value_mix = param((Hq,), self.first_order and spec.value_mix)
        self.conv = None
        if c.short_conv:
            # Channels of q (query heads), k and v (kv heads), with their place among all
            # tensor-parallel ranks' heads.
            G, kv0, kv_all = Hq // Hkv, self.head_offset, self.total_kv_heads
            self.conv = ShortConv([("q", Hq * K, kv_all * G * K, kv0 * G * K),
                                   ("k", Hkv * K, kv_all * K, kv0 * K),
                                   ("v", Hkv * K, kv_all * K, kv0 * K)], c.short_conv, **fk)
        self.reset_parameters()

    def _schedule(self, device: torch.device | None = None) -> torch.Tensor:
        """This rank's slice of the RetNet schedule, [Hkv] fp32."""
        full = retnet_log_decay(self.total_kv_heads, device)
        return full[self.head_offset : self.head_offset + self.num_kv_heads]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Decay at the RetNet schedule (data gate weight zero), norm gains one, the
        higher-order weights of the first-order path zero (the layer starts first order)."""
        if self.decay_bias is not None:
            a = self._schedule(self.decay_bias.device).double()
            # logit(exp(a)) = a - log(1 - exp(a)) = a - log(-expm1(a))
            self.decay_bias.copy_(a - torch.log(-torch.expm1(a)))
        for p in (self.decay_weight, self.key_mix, self.value_mix):
            if p is not None:
                p.zero_()
        if self.norm_weight is not None:
            self.norm_weight.fill_(1.0)
        if self.conv is not None:
            self.conv.reset_parameters()

    def log_decay(self, k: torch.Tensor) -> torch.Tensor | None:
        """The log-decay for keys k [B, T, Hkv, K]: None, [Hkv] or [B, T, Hkv] (<= 0).

        In the compute dtype (fp32, fp64 for fp64 keys)."""
        if self.decay == "none":
            return None
        cdt = compute_dtype(k.dtype)
        if self.decay == "fixed":
            return self._schedule(k.device).to(cdt)
        if self.decay == "learned":
            return F.logsigmoid(self.decay_bias.to(cdt))
        z = torch.einsum("bthk,hk->bth", k.to(cdt), self.decay_weight.to(cdt))
        return F.logsigmoid(z + self.decay_bias.to(cdt)) / DATA_DECAY_TEMPERATURE

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"operator={self.operator}, decay={self.decay}, qk_norm={self.qk_norm}, "
                f"output_norm={self.output_norm}, first_order={self.first_order}, "
                f"mix_norm={self.mix_norm}, "
                f"short_conv={self.short_conv}, "
                f"normalize={self.normalize}, ridge={self.ridge}")

    def state_shapes(self, n: int) -> dict[str, tuple[int, ...] | None]:
        """Field -> shape of the operator's state for n sequences (None: absent)."""
        return operators.state_fields(self.operator, n, self.num_heads, self.num_kv_heads,
                                      self.head_dim, self.head_dim, self.normalize)

    def init_state(self, n: int, device: torch.device | str | None = None,
                   dtype: torch.dtype = torch.float32) -> tuple:
        """A zero state for n sequences (fp32: states accumulate in fp32): the operator's
        state, in a :class:`LayerState` with the conv's inputs when there is a conv."""
        fields = [None if s is None else torch.zeros(s, device=device, dtype=dtype)
                  for s in self.state_shapes(n).values()]
        op = operators.get(self.operator).state_type(*fields)
        if self.conv is None:
            return op
        W, C = self.conv.kernel_size, self.conv.channels
        return LayerState(op, torch.zeros(n, W - 1, C, device=device, dtype=dtype))

    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if q.dim() != 4 or q.shape[2:] != (self.num_heads, self.head_dim):
            raise ValueError(f"q: expected [B, T, {self.num_heads}, {self.head_dim}], "
                             f"got {tuple(q.shape)}")
        for name, x in (("k", k), ("v", v)):
            if x.dim() != 4 or x.shape[2:] != (self.num_kv_heads, self.head_dim):
                raise ValueError(f"{name}: expected [B, T, {self.num_kv_heads}, "
                                 f"{self.head_dim}], got {tuple(x.shape)}")
            if x.dtype != q.dtype:
                raise TypeError(f"{name}: expected dtype {q.dtype} (the dtype of q), "
                                f"got {x.dtype}")

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        initial_state: tuple | None = None,
        output_final_state: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        sp: SequenceParallelism | None = None,
        chunk_size: int | None = None,
        plan: BatchPlan | None = None,
    ) -> tuple[torch.Tensor, tuple | None]:
        """Per-head attention.

        Args:
            q: [B, T, Hq, K]. k, v: [B, T, Hkv, K]. Under ``sp`` each rank passes its
                shard and ``cu_seqlens`` holds global offsets.
            chunk_size: overrides the module's chunk length (decode steps use 1).
            plan: the batch's :class:`~hla_sp.ops.sharding.BatchPlan` instead of
                ``cu_seqlens`` (no host read for the documents).

        Returns:
            (o [B, T, Hq, K] in q's dtype, final state or None)
        """
        self._check(q, k, v)
        op_state, conv_state = self._split_state(initial_state)
        log_decay = self.log_decay(k)
        # The call is validated once, here, on the kv-head view (the decay and the
        # documents are per group); the batch's documents become one plan (built from
        # offsets with one host read unless given), carried unchanged to the conv and
        # to every stage of the operator.
        G = self.num_heads // self.num_kv_heads
        x = validate.check_inputs(
            q[:, :, ::G], k, v, log_decay=log_decay, scale=self.scale, cu_seqlens=cu_seqlens,
            plan=plan, sp=sp, chunk_size=self.chunk_size if chunk_size is None else chunk_size,
            output_final_state=output_final_state)
        # Everything between the projections runs in the compute dtype (fp32, or fp64
        # for fp64 inputs) and is rounded once, at the output: the operators accumulate
        # in it anyway, and normalised q, k are not rounded back to bf16 first.
        in_dtype = q.dtype
        cdt = compute_dtype(in_dtype)
        q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
        conv_final = None
        if self.conv is not None:
            q, k, v, conv_final = self._convolve(q, k, v, conv_state, x, sp,
                                                 output_final_state)
        if self.qk_norm:
            # L2 per head: |q.k| <= 1, so no power of t in S, H can come from key size.
            q = F.normalize(q, dim=-1)
            k = F.normalize(k, dim=-1)
        # The fast path hands the operator 16-bit q, k, v (rounded once, here).
        sdt = stage_dtype(resolve(self.precision, in_dtype, q.device), in_dtype)
        q, k, v = q.to(sdt), k.to(sdt), v.to(sdt)
        mixes = [None if p is None else p.to(sdt) for p in (self.key_mix, self.value_mix)]
        o, state = execute(
            operators.get(self.operator), x, q, k, v, self._options, initial_state=op_state,
            output_final_state=output_final_state, sp=sp, key_mix=mixes[0],
            value_mix=mixes[1], mix_norm=self.mix_norm and any(m is not None for m in mixes),
            precision=self.precision,
        )
        o = o.to(cdt)
        if self.output_norm:
            # Per-head RMSNorm: HLA outputs grow with context (a power of t without
            # decay) and with the head's window; the norm removes the scale, the gain
            # learns it back.
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps)
            o = o * self.norm_weight.to(cdt)
        if state is not None and self.conv is not None:
            state = LayerState(state, conv_final)
        return o.to(in_dtype), state

    def _split_state(self, state: object) -> tuple[tuple | None, torch.Tensor | None]:
        """(operator state, conv state) of a given initial state."""
        if state is None or self.conv is None:
            return state, None  # type: ignore[return-value]
        if not isinstance(state, (tuple, list)) or len(state) != 2 or not isinstance(
                state[1], torch.Tensor):
            raise ValueError("initial_state: expected a LayerState(op, conv) (the layer has a "
                             f"short convolution), got {type(state).__name__}"
                             + (f" of {len(state)} fields" if isinstance(state, tuple) else ""))
        return state[0], state[1]

    def _convolve(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  conv_state: torch.Tensor | None, x: validate.Inputs,
                  sp: SequenceParallelism | None, want_final: bool):
        """The short convolution of q, k, v side by side, for the call ``x`` checked by
        :meth:`forward`; (q, k, v, final conv state)."""
        B, T, Hq, K = q.shape
        Hkv = k.shape[2]
        call = None
        if sp is not None:
            # The taps are an option (not part of the call's name), so that a mismatch
            # reads "short_conv differs across ranks: 4 on ranks [0], 2 on ranks [1]".
            call = sp.check_call(x, op="short-conv/layer", options=dict(
                short_conv=self.short_conv, conv_initial_state=conv_state,
                output_final_state=want_final))
            bounds = None if call.bounds is None else list(call.bounds)
        else:
            bounds = None if x.plan is None or x.plan.bounds is None else list(x.plan.bounds)
        # Explicit widths: an empty shard (T = 0 under sp) cannot infer a -1.
        nq, nk, nv = Hq * K, Hkv * K, Hkv * v.shape[-1]
        xs = torch.cat([q.reshape(B, T, nq), k.reshape(B, T, nk), v.reshape(B, T, nv)], -1)
        y, final = self.conv(xs, bounds=bounds, state=conv_state, want_final=want_final,
                             plan=call)
        # split, not three slices: its gradient is one cat, where each slice's is a
        # zeroed buffer of the whole width and the three are then added
        yq, yk, yv = y.split([nq, nk, nv], dim=-1)
        q = yq.reshape(B, T, Hq, K)
        k = yk.reshape(B, T, Hkv, K)
        v = yv.reshape(B, T, Hkv, v.shape[-1])
        return q, k, v, final

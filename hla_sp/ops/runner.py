"""The one operator runner: validate a call once, agree across ranks, run its stages.

Every operator call comes here: the public functions (:func:`hla_sp.hla2`, ...), the
layer (with its first-order mixes) and user operators registered in the table. The
call may have fewer kv heads than query heads (GQA/MQA); one kv head per query head is
the degenerate group G = 1.

With ``num_kv_heads < num_heads`` the query heads ``g * G .. g * G + G - 1`` share kv
head ``g`` (G = num_heads // num_kv_heads, Megatron's order). Every stage whose key and
value are both kv-head tensors (S = sum k k^T of hla2/hla3/ccq, C = sum k v^T of
ahla/hla3, the state of ``linear``) then has ONE state per group: the stage runs on the
kv heads, and each query head reads it (k~ = S q). Without sequence parallelism the
primitive takes the group's queries itself (multi-query: the state pieces built once per
kv head; the G queries are extra rows of each chunk's query block on the torch path,
:mod:`hla_sp.ops.chunk.layout`, and per-query-head programs reading their kv head's
states in the kernels). Under sequence parallelism each token t becomes G sub-tokens,
the first carrying k_t (and the decay), the others k = 0 and no decay, so the state does
not move while the G query heads of the group read it in turn. Both are exact. The
stages whose key or value depends on the query (H of hla2, ahla, hla3) run per query
head.
"""

from __future__ import annotations

from typing import Any

import torch

from hla_sp.config import PRECISIONS
from hla_sp.ops import table, validate
from hla_sp.ops.dispatch import resolve, stage_dtype
from hla_sp.ops.primitive import DEFAULT_CHUNK_SIZE, primitive
from hla_sp.ops.sharding import BatchPlan
from hla_sp.ops.sp_protocol import SequenceParallelism
from hla_sp.ops.stages import StageContext

__all__ = ["run_operator"]


def _interleave(x: torch.Tensor, groups: int, *, repeat: bool) -> torch.Tensor:
    """[B, T, Hkv, *D] -> [B, T * G, Hkv, *D]: sub-token (t, j) at t * G + j.

    ``repeat``: every sub-token gets x_t; otherwise sub-token 0 gets x_t and the others
    zero (keys, values, decay).
    """
    B, T = x.shape[:2]
    x = x.unsqueeze(2)
    if repeat:
        x = x.expand(B, T, groups, *x.shape[3:])
    else:
        x = torch.cat([x, x.new_zeros(B, T, groups - 1, *x.shape[3:])], dim=2)
    return x.reshape(B, T * groups, *x.shape[3:])


class _Stages:
    """The stages of one call: shared (per kv group) and per query head.

    Under ``sp`` every stage of the call passes the plan of its shape: the per-head
    stages that of the kv-head view checked by the runner, the shared stages (when
    G > 1) that of the interleaved shard, checked once at its first use so that all
    shared stages share one ordering chain.
    """

    def __init__(self, G: int, g: torch.Tensor | None, *, docs: BatchPlan | None,
                 want_final: bool, chunk_size: int, sp: SequenceParallelism | None,
                 plan: Any, scale: float = 1.0):
        # a per-head decay arrives broadcast ([H] -> [B, T, H]): laid out once per call,
        # not once per stage
        g = None if g is None else g.contiguous()
        self.G, self.g, self.cu, self.want_final = G, g, docs, want_final
        self.scale = scale  # q's, applied by every stage (1.0: q arrives scaled)
        self.chunk_size, self.sp, self.plan = chunk_size, sp, plan
        self.gq = None if g is None or G == 1 else g.repeat_interleave(G, dim=-1)
        self.shared_plan = plan if G == 1 else None

    def _primitive(self, q, k, v, g, h0, cu, plan, scale):
        return primitive(q, k, v, g, docs=cu, h0=h0, want_final=self.want_final,
                         chunk_size=self.chunk_size, sp=self.sp, call=plan, scale=scale)

    def per_head(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 h0: torch.Tensor | None, *,
                 scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q, k [B, T, Hq, K], v [B, T, Hq, V]: the primitive per query head, q times
        ``scale`` (the call's if None) in the kernels."""
        g = self.g if self.G == 1 else self.gq
        return self._primitive(q, k, v, g, h0, self.cu, self.plan,
                               self.scale if scale is None else scale)

    def shared(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               h0: torch.Tensor | None, *,
               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q [B, T, Hq, K], k [B, T, Hkv, K], v [B, T, Hkv, V], h0 [N, Hkv, K, V] ->
        (o [B, T, Hq, V] with o[:, t, h] = scale q[:, t, h]^T h_t[h // G],
        final [N, Hkv, K, V]); ``scale`` the call's if None."""
        G = self.G
        scale = self.scale if scale is None else scale
        if G == 1:
            return self._primitive(q, k, v, self.g, h0, self.cu, self.plan, scale)
        if self.sp is None:
            # Multi-query: a chunk holds chunk_size query rows (chunk_size / G tokens of G
            # queries each), as a chunk of the sub-tokens below does; chunk_size tokens
            # would make the in-chunk block G times larger and cost more than it saves.
            return primitive(q, k, v, self.g, docs=self.cu, h0=h0, want_final=self.want_final,
                             chunk_size=max(1, self.chunk_size // G), scale=scale)
        B, T, Hq, K = q.shape
        Hkv = k.shape[2]
        # [B, T, Hkv, G, K] -> [B, T, G, Hkv, K] -> [B, T*G, Hkv, K]: sub-token j reads head j.
        qi = q.view(B, T, Hkv, G, K).transpose(2, 3).reshape(B, T * G, Hkv, K)
        ki = _interleave(k, G, repeat=False)
        vi = _interleave(v, G, repeat=False)
        gi = None if self.g is None else _interleave(self.g, G, repeat=False)
        cu = None if self.cu is None else self.cu * G
        if self.sp is not None and self.shared_plan is None:
            # The interleaved shard is a call of its own (local T * G, offsets * G).
            xi = validate.check_inputs(qi, ki, vi, log_decay=gi, scale=1.0, cu_seqlens=None,
                                       plan=cu, sp=self.sp, chunk_size=self.chunk_size)
            self.shared_plan = self.sp.check_call(xi, op=f"gqa-shared-stage/{G}", options={})
        o, final = self._primitive(qi, ki, vi, gi, h0, cu, self.shared_plan, scale)
        V = v.shape[-1]
        return o.view(B, T, G, Hkv, V).transpose(2, 3).reshape(B, T, Hq, V), final


def _group_size(q: object, k: object, v: object) -> int:
    """G = Hq / Hkv for q [B, T, Hq, K], k [B, T, Hkv, K], v [B, T, Hkv, V]; 1 where the
    head counts are equal or the inputs are not 4-d tensors (the common validation then
    names what is wrong)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 4
            and k.dim() == 4 and k.shape[2] != q.shape[2]):
        return 1
    for name, x in (("q", q), ("k", k), ("v", v)):
        validate.check_tensor(name, x, 4, "[B, T, H, D]")
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
    assert isinstance(v, torch.Tensor)
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
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{name}: expected dtype {q.dtype} on {q.device} (those of q), "
                            f"got {t.dtype} on {t.device}")
    return Hq // Hkv


def run_operator(
    operator: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: Any = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    sp: SequenceParallelism | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    key_mix: torch.Tensor | None = None,
    value_mix: torch.Tensor | None = None,
    mix_norm: bool = False,
    precision: str = "auto",
    plan: BatchPlan | None = None,
    **options: object,
) -> tuple[torch.Tensor, tuple | None]:
    """Run an operator of the table, exact, with Hkv kv heads shared by groups of G.

    Args:
        operator: a name of the operator table (:mod:`hla_sp.ops.table`): "hla2" |
            "ahla" | "hla3" | "ccq" | "linear", or one registered there.
        q: [B, T, Hq, K]. k: [B, T, Hkv, K]. v: [B, T, Hkv, V], Hq a multiple of Hkv.
        log_decay: broadcasts to [B, T, Hkv] (values <= 0); one decay per group.
        initial_state: the operator's state tuple, with the shared fields (S, C, h) over
            Hkv heads and the per-query-head fields (H, eta) over Hq heads; for an
            operator whose public function takes its one field bare (``linear``), that
            tensor is accepted too.
        key_mix, value_mix: [Hq] weights of the first-order path (see
            :class:`hla_sp.ops.stages.StageContext`), or None for the pure
            operator; an operator without that mix ignores it.
        mix_norm: unit-normalise the mixed-in k~ and u per token (``StageContext``).
        precision: "auto" | "exact" | "fast" (:mod:`hla_sp.ops.dispatch`).
        plan: the batch's :class:`~hla_sp.ops.sharding.BatchPlan` instead of
            ``cu_seqlens``.
        options: the operator's own (hla2: normalize, eps, ridge); the others must be
            absent or at their defaults.
        Other keywords as in :func:`hla_sp.hla2`.

    Returns:
        (o [B, T, Hq, V] in q's dtype, the operator's state type or None).
    """
    spec = table.get(operator)
    validate.check_choice("precision", precision, PRECISIONS)
    G = _group_size(q, k, v)
    mixed = key_mix is not None or value_mix is not None
    if mixed and not (spec.key_mix or spec.value_mix):
        takers = tuple(n for n, s in table.TABLE.items() if s.key_mix or s.value_mix)
        raise ValueError(f"key_mix: the first-order path needs an operator among {takers}, "
                         f"got {spec.name!r}")
    # Validated on the kv-head view: the decay and the documents are per group.
    x = validate.check_inputs(
        q if G == 1 else q[:, :, ::G], k, v, log_decay=log_decay, scale=scale,
        cu_seqlens=cu_seqlens, sp=sp, chunk_size=chunk_size,
        output_final_state=output_final_state, plan=plan,
    )
    opts = table.check_options(spec, options)
    mix_norm = validate.check_bool("mix_norm", mix_norm) and mixed
    return execute(spec, x, q, k, v, opts, initial_state=initial_state,
                   output_final_state=output_final_state, sp=sp, key_mix=key_mix,
                   value_mix=value_mix, mix_norm=mix_norm, precision=precision)


def execute(
    spec: table.OperatorSpec,
    x: validate.Inputs,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    opts: dict[str, Any],
    *,
    initial_state: Any = None,
    output_final_state: bool = False,
    sp: SequenceParallelism | None = None,
    key_mix: torch.Tensor | None = None,
    value_mix: torch.Tensor | None = None,
    mix_norm: bool = False,
    precision: str = "auto",
) -> tuple[torch.Tensor, tuple | None]:
    """The call after its validation, for a caller that validated it once at its own
    boundary (:func:`run_operator`, the layer): ``x`` the checked inputs of the kv-head
    view (its decay, documents, scale, chunk size and sizes are used; its tensors only
    describe the call), q [B, T, Hq, K], k [B, T, Hkv, K], v [B, T, Hkv, V] the tensors
    to run, ``opts`` the operator's checked options. The initial state is checked here,
    and under ``sp`` the ranks' agreement."""
    G = q.shape[2] // x.H
    mixed = key_mix is not None or value_mix is not None
    precision = resolve(precision, q.dtype, q.device)
    fields = table.state_fields(spec.name, x.n_seq, x.H * G, x.H, x.K, x.V, **opts)
    if spec.bare_state and isinstance(initial_state, torch.Tensor):
        initial_state = (initial_state,)
    s0 = validate.check_state_tuple(initial_state, fields, q)
    agreed = None
    if sp is not None:
        # output_final_state decides whether the final states are all-reduced: agree on it.
        agree: dict[str, object] = dict(opts)
        if mixed:
            agree.update(key_mix=key_mix, value_mix=value_mix, mix_norm=mix_norm)
        agree.update(output_final_state=output_final_state, initial_state=s0)
        if spec.precision:
            agree["precision"] = precision
        agreed = sp.check_call(x, op=spec.name if G == 1 else f"{spec.name}/gqa{G}",
                               options=agree)
    # The scale rides into the kernels where the operator's stages allow it. Under
    # sequence parallelism every stage would scale q before its exchange: once here.
    inside = spec.scale_in_kernels and sp is None
    stages = _Stages(G, x.g, docs=x.plan, want_final=output_final_state,
                     chunk_size=x.chunk_size, sp=sp, plan=agreed,
                     scale=x.scale if inside else 1.0)
    # One stage has nothing to exchange between stages: it runs in the inputs' dtype.
    cdt = stage_dtype(precision, q.dtype) if spec.precision else q.dtype
    ctx = StageContext(stages.shared, stages.per_head,
                       expand=(lambda t: t) if G == 1 else
                       (lambda t: t.repeat_interleave(G, dim=2)),
                       key_mix=key_mix, value_mix=value_mix, mix_norm=mix_norm, options=opts,
                       scale=x.scale if inside else 1.0)
    qs = q.to(cdt) if inside else q.to(cdt) * x.scale
    o, final = spec.stages(ctx, qs, k.to(cdt), v.to(cdt), s0)
    state = spec.state_type(*final) if output_final_state else None
    return o.to(q.dtype), state

"""``HLACoreAttention``: HLA in megatron-core's ``core_attention`` slot.

It receives per-head q, k, v from Megatron's ``SelfAttention`` (after its QKV
projection) and returns the context layer. Everything between is
:class:`hla_sp.nn.HLAHeads`, the module the plain layer uses too.

Context parallelism: Megatron's ``get_batch_on_this_cp_rank`` cuts the sequence into
2P equal chunks and gives rank r chunks r and 2P-1-r. That is the ``zigzag`` layout
of :class:`hla_sp.SequenceParallel`, so each rank runs the operator on its shard as it
is: no all-to-all, no resharding; only the segment summaries cross ranks.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from typing import Any

import torch
from hla_sp.megatron_patch.documents import DocumentParams
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from hla_sp.config import HLAConfig
from hla_sp.nn import HLAHeads

# HLA is causal by construction; a THD batch may say padding_causal (its padding is
# described by cu_seqlens, which we use).
_CAUSAL = ("causal", "padding_causal")


def _group_size_rank(group: Any) -> tuple[int, int]:
    if group is None:
        return 1, 0
    if hasattr(group, "size") and hasattr(group, "rank") and not isinstance(group, list):
        return group.size(), group.rank()
    return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


class RecurrentState:
    """One layer's decode state across GPTModel forwards (``hla_sp.launch.export.generate``).

    While a core attention holds one (``core.recurrent = RecurrentState()``), each of its
    forwards continues from ``state`` (None: a fresh sequence) and leaves its final state
    there: a forward over the prompt is the prefill (chunk-parallel), a forward over one
    token a decode step, O(1) in the context length. The state is what
    :meth:`hla_sp.nn.HLAHeads.init_state` describes (a ``LayerState`` with a short conv).
    """

    def __init__(self) -> None:
        self.state: tuple | None = None


class HLACoreAttention(MegatronModule):
    """Higher-order linear attention for megatron-core's ``SelfAttention``.

    Constructor arguments are those of megatron-core's ``DotProductAttention``; the
    HLA options (keyword-only) come from the layer spec's ``params``.

    Args:
        config: the TransformerConfig (heads, kv_channels, num_query_groups, dtype).
        layer_number, attn_mask_type, attention_type: as in DotProductAttention;
            attn_mask_type must be causal.
        attention_dropout: unused (there is no attention matrix to drop); a non-zero
            value is reported once.
        softmax_scale: the query scale of the operator; None means kv_channels ** -0.5.
        cp_comm_type: unused (the exchange method is ``sp_method``).
        pg_collection: process groups; ``tp`` and ``cp`` are used when present,
            else megatron's ``parallel_state``.
        hla: the layer spec's :class:`hla_sp.config.HLAConfig`, whole (operator, decay,
            first_order, short_conv, ..., and sp_method, the exchange of the segment
            summaries across the context-parallel group); or, without it,
        options: its fields, keyword-only; checked by it.
    """

    # set while decoding (see RecurrentState); None: every forward is a whole sequence
    recurrent: RecurrentState | None = None

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        hla: HLAConfig | None = None,
        **options: Any,
    ):
        super().__init__(config=config)
        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self._check_mask_type(attn_mask_type)
        if hla is None:
            hla = HLAConfig(**options)
        elif options:
            raise TypeError(f"options: expected none with hla (an HLAConfig holds them all), "
                            f"got {sorted(options)}")
        self.sp_method = hla.sp_method
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            # Megatron-LM's default is 0.1; failing would break stock command lines.
            warnings.warn(
                f"HLACoreAttention: attention_dropout = {dropout} is ignored (HLA has no "
                "attention matrix to drop); set --attention-dropout 0 to silence this",
                stacklevel=2,
            )

        tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
        if tp_group is None:
            tp_group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
        self.tp_group = tp_group
        tp_size, tp_rank = _group_size_rank(tp_group)
        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self._cp_group_given = cp_group
        self._sp_cache: dict[int, Any] = {}

        heads = config.num_attention_heads
        groups = config.num_query_groups or heads
        if heads % tp_size or groups % tp_size:
            raise ValueError(
                f"config: expected num_attention_heads ({heads}) and num_query_groups "
                f"({groups}) divisible by the tensor-parallel size {tp_size}"
            )
        head_dim = config.kv_channels
        if config.apply_query_key_layer_scaling:
            # A softmax trick (divide scores by the layer number, multiply back in the
            # fp32 softmax); HLA has no softmax, so it would only rescale q.
            warnings.warn("HLACoreAttention: apply_query_key_layer_scaling is ignored",
                          stacklevel=2)
        if config.use_cpu_initialization or not torch.cuda.is_available():
            device = torch.device("cpu")
        else:
            device = torch.device("cuda", torch.cuda.current_device())
        ng = groups // tp_size
        # Megatron's softmax_scale is the operator's query scale (None: kv_channels ** -0.5)
        scaled = hla if hla.scale == softmax_scale else hla.replace(scale=softmax_scale)
        self.heads = HLAHeads(
            heads // tp_size, ng, head_dim, config=scaled,
            head_offset=tp_rank * ng, total_kv_heads=groups, device=device,
            dtype=config.params_dtype,
        )
        # Each tensor-parallel rank owns its heads' slice: mark the parameters as split
        # along dim 0, like the QKV weight, so grad-norm and checkpoints treat them so.
        for p in self.heads.parameters():
            tensor_parallel.set_tensor_model_parallel_attributes(p, tp_size > 1, 0, 1)

    @property
    def operator(self) -> str:
        return self.heads.operator

    @staticmethod
    def _check_mask_type(mask_type: Any) -> None:
        name = getattr(mask_type, "name", str(mask_type))
        if name not in _CAUSAL:
            raise ValueError(
                f"attn_mask_type: expected AttnMaskType.causal (HLA is causal by "
                f"construction; documents are cut by packed_seq_params), got {mask_type}"
            )

    def _cp_group(self, packed_seq_params: Any) -> Any:
        # Hybrid CP (newer megatron-core) carries its group in the packed params.
        group = getattr(packed_seq_params, "cp_group", None) if packed_seq_params else None
        if group is not None:
            return group
        if self._cp_group_given is not None:
            return self._cp_group_given
        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_context_parallel_group(check_initialized=False)
        return None

    def _sequence_parallel(self, group: Any) -> Any:
        """The SequenceParallel of a CP group (None for a single rank), cached."""
        size, _ = _group_size_rank(group)
        if size <= 1:
            return None
        key = id(group)
        if key not in self._sp_cache:
            from hla_sp.parallel import SequenceParallel

            self._sp_cache[key] = SequenceParallel(
                group=group, layout="zigzag", method=self.sp_method
            )
        return self._sp_cache[key]

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        """HLA over this rank's shard.

        Args:
            query: [sq, b, np, hn], or [t, np, hn] for a THD packed batch.
            key, value: [sk, b, ng, hn] (ng divides np: GQA), or [t, ng, hn].
            attention_mask: ignored: HLA is causal, and packed documents are cut by
                ``packed_seq_params``' cu_seqlens (global offsets under CP).
            attn_mask_type: must be causal (or padding_causal with THD).
            attention_bias: must be None.
            packed_seq_params: THD batches: ``cu_seqlens_q_padded`` (else
                ``cu_seqlens_q``) gives the documents' global offsets. A
                :class:`~hla_sp.megatron_patch.documents.DocumentParams` (sbhd,
                ``--reset-attention-mask``): each row's documents, cut at its EODs.

        Returns:
            [sq, b, np * hn] (THD: [t, np * hn]) in query's dtype.
        """
        if attention_bias is not None:
            raise ValueError("attention_bias: expected None (HLA has no score matrix to bias)")
        if attn_mask_type is not None:
            self._check_mask_type(attn_mask_type)
        fmt = getattr(packed_seq_params, "qkv_format", None) if packed_seq_params else None
        cu_seqlens = None
        if fmt == "thd":
            cu_seqlens = packed_seq_params.cu_seqlens_q_padded
            if cu_seqlens is None:
                cu_seqlens = packed_seq_params.cu_seqlens_q
        elif fmt not in (None, "sbhd", "bshd"):
            raise ValueError(f"packed_seq_params.qkv_format: expected 'thd' or 'sbhd', got {fmt!r}")
        if query.dim() == 3:
            if fmt != "thd":
                raise ValueError(
                    f"query: a 3-D query [t, np, hn] needs packed_seq_params with qkv_format "
                    f"'thd', got shape {tuple(query.shape)} and format {fmt!r}"
                )
            q, k, v = (x.unsqueeze(0) for x in (query, key, value))
        elif query.dim() == 4:
            # [s, b, h, d] -> [b, s, h, d]: the operators take batch first.
            q, k, v = (x.transpose(0, 1) for x in (query, key, value))
        else:
            raise ValueError(f"query: expected [sq, b, np, hn] or [t, np, hn], "
                             f"got shape {tuple(query.shape)}")
        if cu_seqlens is not None and q.shape[0] != 1:
            raise ValueError(f"query: a THD batch has batch size 1, got {q.shape[0]}")
        sp = self._sequence_parallel(self._cp_group(packed_seq_params))
        if isinstance(packed_seq_params, DocumentParams):
            if self.recurrent is not None:
                raise ValueError("packed_seq_params: expected no documents while decoding "
                                 "(HLACoreAttention.recurrent is set), got DocumentParams")
            o = self._documents(q, k, v, packed_seq_params, sp)
        elif self.recurrent is not None:
            o = self._continue(q, k, v, cu_seqlens, sp)
        else:
            plan = batch_plan(packed_seq_params, cu_seqlens, q.shape[1], sp)
            o, _ = self.heads(q, k, v, sp=sp, plan=plan)
        width = o.shape[2] * o.shape[3]  # explicit: a -1 is ambiguous for an empty shard
        if query.dim() == 3:
            return o.reshape(o.shape[1], width)
        return o.transpose(0, 1).reshape(o.shape[1], o.shape[0], width)

    def _documents(self, q: Tensor, k: Tensor, v: Tensor, docs: DocumentParams,
                   sp: Any) -> Tensor:
        """The operator over q, k, v [B, T, H, K] with each row cut into ``docs``' documents
        (``--reset-attention-mask``): one call over the rows laid end to end on one rank;
        under CP one call per row, as the zigzag shard of each row is its own sequence."""
        B, T = q.shape[:2]
        P = 1 if sp is None else _group_size_rank(sp.group)[0]
        ends = [int(off[-1]) for off in docs.row_offsets]
        if len(ends) != B or any(e != T * P for e in ends):
            raise ValueError(
                f"packed_seq_params.row_offsets: expected {B} rows of documents over "
                f"{T * P} tokens each (the whole rows, before the CP split), got {len(ends)} "
                f"rows ending at {ends}")
        if sp is None:
            plan = docs.plan("joined", B * T, None, docs.joined(T))
            o, _ = self.heads(*(x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v)),
                              plan=plan)
            return o.reshape(B, T, *o.shape[2:])
        outs = []
        for i, off in enumerate(docs.row_offsets):
            plan = docs.plan(i, T, sp, off)
            outs.append(self.heads(q[i:i + 1], k[i:i + 1], v[i:i + 1], sp=sp, plan=plan)[0])
        return torch.cat(outs, 0)

    def _continue(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor | None,
                  sp: Any) -> Tensor:
        """The operator over q, k, v [B, T, H, K] from the held state, which it replaces
        by the final one (a decode: one process, one sequence per batch row)."""
        if cu_seqlens is not None or sp is not None:
            raise ValueError(
                "HLACoreAttention.recurrent: decoding runs one sequence per batch row on one "
                f"context-parallel rank, got {'a THD batch' if sp is None else 'a CP group'}")
        assert self.recurrent is not None
        # One token has T = 1: the operator caps its chunk at T, so a step is one
        # recurrent update, not a padded training chunk.
        o, self.recurrent.state = self.heads(q, k, v, initial_state=self.recurrent.state,
                                             output_final_state=True)
        return o

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> Any:
        """Checkpoint entries: the per-head parameters are split along dim 0 across TP."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state_dict = self.state_dict(prefix="", keep_vars=True)
        axis_map = {name: 0 for name in state_dict}
        kwargs: dict[str, Any] = {}
        params = inspect.signature(make_sharded_tensors_for_checkpoint).parameters
        if "tp_group" in params:
            kwargs["tp_group"] = self.tp_group
        if "dp_cp_group" in params:
            kwargs["dp_cp_group"] = (metadata or {}).get("dp_cp_group")
        return make_sharded_tensors_for_checkpoint(
            state_dict, prefix, axis_map, sharded_offsets, **kwargs
        )


# The plan of the micro-batch in flight: (weak references to its packed_seq_params and
# cu_seqlens, the facts it was planned for, the plan). One entry: micro-batches run
# one after another, and every layer of one sees the same packed_seq_params object.
_LAST_PLAN: list[tuple[Any, Any, tuple, Any]] = []


def batch_plan(packed_seq_params: Any, cu_seqlens: Tensor | None, T_local: int,
               sp: Any) -> Any:
    """The micro-batch's :class:`~hla_sp.ops.sharding.BatchPlan`, built by its first
    layer (one host read of cu_seqlens; under CP one all-gather, on every rank, as
    every rank runs the same layers) and reused by the 2nd..Nth layer and by
    activation recomputation: the cache is keyed on the packed_seq_params object and
    its cu_seqlens tensor (identity and in-place version), the local length and the
    SequenceParallel. None without documents (Megatron's CP layout is zigzag, whose
    lengths every rank knows: nothing to plan)."""
    if cu_seqlens is None:
        return None
    cu = cu_seqlens.detach().reshape(-1)
    facts = (T_local, id(sp), cu.data_ptr(), cu._version)
    if _LAST_PLAN:
        params_ref, cu_ref, seen, plan = _LAST_PLAN[0]
        if params_ref() is packed_seq_params and cu_ref() is cu_seqlens and seen == facts:
            return plan
    if sp is None:
        from hla_sp.ops.sharding import plan_documents

        plan = plan_documents(cu, T_local)
    else:
        plan = sp.plan_batch(T_local, cu)
    _LAST_PLAN.clear()
    # An object without weak references (TypeError): plan per layer, uncached.
    with contextlib.suppress(TypeError):
        _LAST_PLAN.append((weakref.ref(packed_seq_params), weakref.ref(cu_seqlens), facts,
                           plan))
    return plan

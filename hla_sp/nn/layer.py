"""The HLA attention layer for plain PyTorch models: projections and streaming decode.

x [B, T, hidden] -> q, k, v projections -> :class:`~hla_sp.nn.heads.HLAHeads` -> output
projection; :meth:`HLAttention.init_state` and :meth:`HLAttention.step` decode one token
at a time in O(1) of the context length.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from hla_sp.config import HLAConfig
from hla_sp.nn.heads import HEADS_OPTIONS, HLAHeads
from hla_sp.ops import validate
from hla_sp.ops.sharding import BatchPlan
from hla_sp.ops.sp_protocol import SequenceParallelism


class HLAttention(nn.Module):
    """Higher-order linear attention layer for a plain PyTorch model.

    x [B, T, hidden] -> q, k, v projections -> :class:`HLAHeads` -> output projection.

    Args:
        hidden_size: model width D.
        num_heads: query heads Hq.
        head_dim: per-head width K (= V); default hidden_size // num_heads.
        num_kv_heads: key/value heads (GQA/MQA); default num_heads.
        bias: biases in the projections.
        options: the HLA options, keyword-only, as :class:`HLAHeads` takes them: operator,
            decay, qk_norm, output_norm, first_order, short_conv, normalize, eps, ridge,
            scale, chunk_size (the fields of :class:`hla_sp.config.HLAConfig`, whose
            defaults they have).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int | None = None,
        num_kv_heads: int | None = None,
        *,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **options: Any,
    ):
        super().__init__()
        self.hidden_size = validate.check_pos_int("hidden_size", hidden_size)
        validate.check_pos_int("num_heads", num_heads)
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"head_dim: needed, as num_heads = {num_heads} does not "
                                 f"divide hidden_size = {hidden_size}")
            head_dim = hidden_size // num_heads
        unknown = sorted(set(options) - set(HEADS_OPTIONS))
        if unknown:
            raise TypeError(f"options: expected HLA options among {HEADS_OPTIONS}, got {unknown}")
        self.heads = HLAHeads(num_heads, num_kv_heads, head_dim, device=device, dtype=dtype,
                              **options)
        Hq, Hkv, K = self.heads.num_heads, self.heads.num_kv_heads, self.heads.head_dim
        fk = dict(bias=bias, device=device, dtype=dtype)
        self.q_proj = nn.Linear(hidden_size, Hq * K, **fk)
        self.k_proj = nn.Linear(hidden_size, Hkv * K, **fk)
        self.v_proj = nn.Linear(hidden_size, Hkv * K, **fk)
        self.o_proj = nn.Linear(Hq * K, hidden_size, **fk)

    @classmethod
    def from_config(cls, hidden_size: int, num_heads: int, config: HLAConfig, **kwargs
                    ) -> HLAttention:
        """The layer with ``config``'s options (``kwargs``: head_dim, num_kv_heads, bias,
        device, dtype)."""
        return cls(hidden_size, num_heads, **config.heads_kwargs(), **kwargs)

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
        sp: SequenceParallelism | None = None,
        chunk_size: int | None = None,
        plan: BatchPlan | None = None,
    ) -> tuple[torch.Tensor, tuple | None]:
        """x [B, T, hidden] -> (y [B, T, hidden], final state or None).

        ``cu_seqlens`` (B == 1) packs documents, or ``plan``, the batch's
        :class:`~hla_sp.ops.sharding.BatchPlan` built once for every layer; ``sp`` runs
        sequence parallelism (each rank passes its shard); ``initial_state`` continues
        from a state of :meth:`init_state` / a previous call.
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
                     cu_seqlens=cu_seqlens, sp=sp, chunk_size=chunk_size, plan=plan)
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

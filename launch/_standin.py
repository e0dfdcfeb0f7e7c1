"""TEMPORARY: a CPU softmax core attention (CP = 1 only) until hla_sp.megatron_patch lands."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule


class _SDPA(MegatronModule):
    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: Any,
        attention_dropout: Any = None,
        softmax_scale: Any = None,
        cp_comm_type: Any = None,
        pg_collection: Any = None,
        **kw: Any,
    ):
        super().__init__(config=config)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        sq, b, nh, hn = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )
        return o.permute(2, 0, 1, 3).reshape(sq, b, nh * hn)


def softmax_cpu_spec() -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = _SDPA
    return spec

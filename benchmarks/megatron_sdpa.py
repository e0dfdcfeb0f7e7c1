"""Megatron's local GPT layer with causal softmax attention on SDPA's flash backend.

The softmax baseline of the Megatron loop (``benchmarks/gpu_megatron.sh``) without
Transformer Engine: ``--transformer-impl local`` gives Megatron's unfused
DotProductAttention, which materialises [b, heads, T, T] scores (16 GiB a layer at
32k) and is no fair peer for HLA. This spec is the same local layer with the core
attention computed by ``F.scaled_dot_product_attention(is_causal=True)`` on the flash
backend (the math backend on a CPU): the same function, flash's memory and speed.

    --spec megatron_sdpa sdpa_layer_spec        (with benchmarks/ on PYTHONPATH)

``sdpa_layer_spec`` uses RMSNorm, as the lease's HLA runs do (``--normalization RMSNorm``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch.nn.attention import SDPBackend, sdpa_kernel


class SDPAFlashAttention(DotProductAttention):
    """DotProductAttention's interface and scale, causal SDPA inside (no T x T scores)."""

    announced = False  # the first call says which backend runs, once per process

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Any, attn_mask_type: Any = None, attention_bias: Any = None,
                packed_seq_params: Any = None) -> torch.Tensor:
        """query [sq, b, np, hn], key and value [sk, b, ng, hn] -> [sq, b, np * hn]."""
        mask = attn_mask_type or self.attn_mask_type
        if packed_seq_params is not None or attention_bias is not None \
                or mask != AttnMaskType.causal:
            raise ValueError(f"SDPAFlashAttention: expected causal attention without packed "
                             f"sequences or bias, got mask {mask}, packed "
                             f"{packed_seq_params is not None}, bias {attention_bias is not None}")
        sq, b, heads, hn = query.shape
        rep = heads // key.shape[2]
        q = query.permute(1, 2, 0, 3)
        k, v = (x.permute(1, 2, 0, 3) for x in (key, value))
        if rep > 1:  # GQA: each kv head serves rep query heads, as DotProductAttention does
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # DotProductAttention divides the scale by the layer number under query-key layer
        # scaling and multiplies it back in its softmax: the net scale is this one.
        scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling
                                      else 1)
        drop = self.attention_dropout.p if self.training else 0.0
        backend = SDPBackend.FLASH_ATTENTION if q.is_cuda else SDPBackend.MATH
        if not SDPAFlashAttention.announced:
            SDPAFlashAttention.announced = True
            print(f"> softmax core attention: SDPAFlashAttention, backend {backend.name}",
                  flush=True)
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True,
                                               scale=scale)
        return o.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)


def layer_spec(normalization: str = "RMSNorm") -> Any:
    """``get_gpt_layer_local_spec`` with :class:`SDPAFlashAttention` as core attention."""
    spec = get_gpt_layer_local_spec(normalization=normalization)
    spec.submodules.self_attention.submodules.core_attention = SDPAFlashAttention
    return spec


sdpa_layer_spec = layer_spec()

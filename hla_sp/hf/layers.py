"""The blocks of an hla-sp GPT in plain PyTorch, with megatron-core's local-spec math.

One transformer layer is Megatron's pre-norm block: x + proj(HLA(qkv(LN(x)))), then
x + fc2(gelu(fc1(LN(x)))), every linear layer with its bias. The fused QKV projection
keeps Megatron's layout, one block per query group [q_1 .. q_{H/G}, k, v], so its weight
is the trainer's tensor as it is; the attention core is the same
:class:`hla_sp.nn.HLAHeads` Megatron's ``HLACoreAttention`` runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hla_sp.hf.configuration import HLASPConfig
from hla_sp.nn import HLAHeads

# Marks the linear layers that write into the residual stream (attention output, MLP
# fc2): Megatron initialises them with std / sqrt(2 x layers).
SCALED_INIT = "_hla_sp_scaled_init"


def rope_cos_sin(config: HLASPConfig, start: int, length: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles at positions start..start+length-1, [length, D] fp32
    (D the rotated width): Megatron's frequencies, in its order of operations (fp32
    inverse frequencies, fp32 positions, each frequency twice: [f, f])."""
    dim = config.head_dim
    if config.rotary_percent < 1.0:
        dim = int(dim * config.rotary_percent)
    inv_freq = 1.0 / (config.rotary_base
                      ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    pos = torch.arange(length, dtype=torch.float32, device=device) + start
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return torch.cos(emb), torch.sin(emb)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first D channels of each head of x [B, T, H, K] (the rest pass), with
    cos, sin [T, D] fp32 rounded to x's dtype first, as Megatron does."""
    d = cos.shape[-1]
    c, s = (t.to(x.dtype)[None, :, None, :] for t in (cos, sin))
    rot, rest = x[..., :d], x[..., d:]
    a, b = torch.chunk(rot, 2, dim=-1)
    rot = rot * c + torch.cat((-b, a), dim=-1) * s
    return torch.cat((rot, rest), dim=-1)


class HLASPAttention(nn.Module):
    """Fused QKV projection, optional rope, HLA core, output projection.

    The state of a decode goes in and out of :meth:`forward` explicitly.
    """

    def __init__(self, config: HLASPConfig):
        super().__init__()
        self.config = config
        H, G, K = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.qkv = nn.Linear(config.hidden_size, (H + 2 * G) * K)
        self.heads = HLAHeads(H, G, K, **config.hla_config().heads_kwargs())
        self.proj = nn.Linear(H * K, config.hidden_size)
        setattr(self.proj, SCALED_INIT, True)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                state: Any, want_state: bool) -> tuple[torch.Tensor, Any]:
        """x [B, T, hidden] -> ([B, T, hidden], the final state or None). ``state`` None:
        a fresh sequence; ``want_state``: return the state after the last token."""
        B, T, _ = x.shape
        H, G, K = self.config.num_attention_heads, self.config.num_key_value_heads, \
            self.config.head_dim
        # Megatron's layout: per query group, the group's H/G query heads, its key, its value
        mixed = self.qkv(x).view(B, T, G, (H // G + 2) * K)
        q, k, v = torch.split(mixed, [H // G * K, K, K], dim=-1)
        q = q.reshape(B, T, H, K)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        o, state = self.heads(q, k, v, initial_state=state, output_final_state=want_state)
        return self.proj(o.reshape(B, T, H * K)), state


class HLASPMLP(nn.Module):
    """fc2(gelu(fc1(x))) with biases (Megatron's non-gated MLP, exact erf GeLU)."""

    def __init__(self, config: HLASPConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        setattr(self.fc2, SCALED_INIT, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]."""
        return self.fc2(F.gelu(self.fc1(x)))


class HLASPBlock(nn.Module):
    """Megatron's pre-norm transformer layer with HLA attention."""

    def __init__(self, config: HLASPConfig):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = HLASPAttention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size,
                                                     eps=config.layer_norm_eps)
        self.mlp = HLASPMLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                state: Any, want_state: bool) -> tuple[torch.Tensor, Any]:
        """x [B, T, hidden] -> ([B, T, hidden], this layer's final state or None)."""
        a, state = self.attention(self.input_layernorm(x), rope, state, want_state)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), state

"""``HLASPConfig``: the architecture of an hla-sp GPT for Hugging Face ``transformers``.

It holds what megatron-core's GPTModel was built from (sizes, norm epsilon, positions,
the unpadded vocabulary, the document-end token) and every HLA option, one field
``hla_<name>`` per field of :class:`hla_sp.config.HLAConfig`, so that
:meth:`HLASPConfig.hla_config` rebuilds the exact HLAConfig the trainer used.
``hla_sp.launch.export.hf_convert.hf_config_from_train`` makes one from a training config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import PretrainedConfig

from hla_sp.config import HLAConfig

POSITION_TYPES = ("learned_absolute", "rope", "none")
# The HLA options, stored flat (JSON-friendly, visible in config.json) under this prefix.
HLA_PREFIX = "hla_"
HLA_FIELDS = tuple(f.name for f in dataclasses.fields(HLAConfig))


def _pos_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return value


class HLASPConfig(PretrainedConfig):
    """An hla-sp GPT: Megatron's pre-norm GPT block (LayerNorm, GeLU MLP, biases) with
    HLA as the attention core.

    Args:
        vocab_size: the tokenizer's vocabulary, unpadded (Megatron's padding rows are
            dropped on export).
        hidden_size, num_hidden_layers, num_attention_heads: as in Megatron.
        num_key_value_heads: Megatron's query groups (GQA); None: one per head.
        intermediate_size: the MLP's hidden size; None: 4 x hidden_size.
        layer_norm_eps: epsilon of every LayerNorm.
        position_embedding_type: learned_absolute | rope | none.
        max_position_embeddings: the learned table's size (the longest context it embeds).
        rotary_base, rotary_percent: rope's frequency base and rotated fraction of a head.
        initializer_range: std of the normal initialisation (Megatron's init_method_std).
        eod_token_id: the token that ends a document (also bos, eos and pad by default);
            None: the last id (256 of the byte vocabulary's 257).
        hla_<option>: each field of :class:`hla_sp.config.HLAConfig` (hla_operator,
            hla_decay, hla_short_conv, ...); defaults are HLAConfig's.
    """

    model_type = "hla_sp"

    def __init__(
        self,
        vocab_size: int = 257,
        hidden_size: int = 64,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_key_value_heads: int | None = None,
        intermediate_size: int | None = None,
        layer_norm_eps: float = 1e-5,
        position_embedding_type: str = "learned_absolute",
        max_position_embeddings: int = 256,
        rotary_base: int = 10000,
        rotary_percent: float = 1.0,
        initializer_range: float = 0.02,
        eod_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        tie_word_embeddings: bool = True,
        use_cache: bool = True,
        **kwargs: Any,
    ):
        defaults = HLAConfig()
        for name in HLA_FIELDS:
            setattr(self, HLA_PREFIX + name,
                    kwargs.pop(HLA_PREFIX + name, getattr(defaults, name)))
        self.vocab_size = _pos_int("vocab_size", vocab_size)
        self.hidden_size = _pos_int("hidden_size", hidden_size)
        self.num_hidden_layers = _pos_int("num_hidden_layers", num_hidden_layers)
        self.num_attention_heads = _pos_int("num_attention_heads", num_attention_heads)
        if hidden_size % num_attention_heads:
            raise ValueError(f"num_attention_heads: expected a divisor of hidden_size = "
                             f"{hidden_size}, got {num_attention_heads}")
        groups = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.num_key_value_heads = _pos_int("num_key_value_heads", groups)
        if num_attention_heads % groups:
            raise ValueError(f"num_key_value_heads: expected a divisor of num_attention_heads = "
                             f"{num_attention_heads}, got {groups}")
        ffn = 4 * hidden_size if intermediate_size is None else intermediate_size
        self.intermediate_size = _pos_int("intermediate_size", ffn)
        self.layer_norm_eps = float(layer_norm_eps)
        if position_embedding_type not in POSITION_TYPES:
            raise ValueError(f"position_embedding_type: expected one of {POSITION_TYPES}, "
                             f"got {position_embedding_type!r}")
        self.position_embedding_type = position_embedding_type
        self.max_position_embeddings = _pos_int("max_position_embeddings",
                                                max_position_embeddings)
        self.rotary_base = rotary_base
        if not 0.0 < rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent: expected 0 < rotary_percent <= 1, "
                             f"got {rotary_percent!r}")
        self.rotary_percent = float(rotary_percent)
        self.initializer_range = float(initializer_range)
        if eod_token_id is None:
            eod_token_id = vocab_size - 1
        if isinstance(eod_token_id, bool) or not 0 <= eod_token_id < vocab_size:
            raise ValueError(f"eod_token_id: expected 0 <= id < vocab_size = {vocab_size}, "
                             f"got {eod_token_id!r}")
        self.eod_token_id = eod_token_id
        self.use_cache = use_cache
        self.hla_config()  # the HLA options are checked here, by HLAConfig itself
        super().__init__(
            bos_token_id=eod_token_id if bos_token_id is None else bos_token_id,
            eos_token_id=eod_token_id if eos_token_id is None else eos_token_id,
            pad_token_id=eod_token_id if pad_token_id is None else pad_token_id,
            tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def head_dim(self) -> int:
        """Per-head width K (Megatron's kv_channels)."""
        return self.hidden_size // self.num_attention_heads

    def hla_config(self) -> HLAConfig:
        """The :class:`HLAConfig` of the attention cores (checked on construction)."""
        return HLAConfig(**{name: getattr(self, HLA_PREFIX + name) for name in HLA_FIELDS})

"""From the trainer's megatron-core GPTModel to the Hugging Face model of ``hla_sp.hf``.

* :func:`hf_config_from_train`: the :class:`~hla_sp.hf.HLASPConfig` of a training config,
  read from the TransformerConfig the trainer builds (sizes, norm epsilon, activation)
  and the HLA options its layer spec gets;
* :func:`hf_state_dict`: a single-process GPTModel's weights (whole tensors, as
  ``hla_sp.launch.export.generate.load_model`` builds it) under the HF model's names, with
  Megatron's padded vocabulary rows dropped and the tied output layer stored once.

Softmax and hybrid models (``--attention softmax``, ``--hla-layer-pattern``) are refused:
the HF model has HLA in every layer.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from hla_sp.launch.config.train_config import TrainConfig
from hla_sp.launch.export.generate import decode_config
from hla_sp.launch.model.build import model_dtype, softmax_layers, transformer_config

from hla_sp.hf import HLASPConfig, HLASPForCausalLM


class ConvertError(ValueError):
    """A model or config the HF model cannot represent; the message is one line."""


def hf_config_from_train(cfg: TrainConfig, vocab_size: int, eod: int) -> HLASPConfig:
    """The HF config of the GPTModel ``build_model(cfg, vocab_size)`` builds.

    Args:
        cfg: the training config (a checkpoint's ``config.json``, read by TrainConfig).
        vocab_size: the tokenizer's vocabulary, unpadded.
        eod: the document-end token (bos, eos and pad of the HF model).
    """

    softmax = softmax_layers(cfg)
    if softmax is not None:
        raise ConvertError(f"attention: expected HLA in every layer (the HF model has no "
                           f"softmax layers), got {softmax}")
    tc = transformer_config(decode_config(cfg))
    unsupported = {
        "normalization": (tc.normalization, "LayerNorm"),
        "activation_func": (getattr(tc.activation_func, "__name__", tc.activation_func), "gelu"),
        "gated_linear_unit": (tc.gated_linear_unit, False),
        "add_bias_linear": (tc.add_bias_linear, True),
        "add_qkv_bias": (tc.add_qkv_bias or tc.add_bias_linear, True),
        "qk_layernorm": (tc.qk_layernorm, False),
        "layernorm_zero_centered_gamma": (tc.layernorm_zero_centered_gamma, False),
        "apply_residual_connection_post_layernorm": (
            tc.apply_residual_connection_post_layernorm, False),
        "kv_channels": (tc.kv_channels, cfg.model.hidden_size // cfg.model.num_attention_heads),
    }
    for name, (got, want) in unsupported.items():
        if got != want:
            raise ConvertError(f"TransformerConfig.{name}: expected {want!r} (what the HF "
                               f"model computes), got {got!r}")
    # the run's HLAConfig, whole; HLACoreAttention passes Megatron's softmax_scale as the
    # query scale
    hla = cfg.hla if cfg.hla.scale == tc.softmax_scale else cfg.hla.replace(
        scale=tc.softmax_scale)
    return HLASPConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.model.hidden_size,
        num_hidden_layers=cfg.model.num_layers,
        num_attention_heads=cfg.model.num_attention_heads,
        num_key_value_heads=tc.num_query_groups or cfg.model.num_attention_heads,
        intermediate_size=tc.ffn_hidden_size,
        layer_norm_eps=tc.layernorm_epsilon,
        position_embedding_type=cfg.model.position_embedding_type,
        max_position_embeddings=cfg.model.max_position_embeddings or cfg.model.seq_length,
        rotary_base=cfg.model.rotary_base,
        rotary_percent=cfg.model.rotary_percent,
        initializer_range=cfg.model.init_method_std,
        eod_token_id=eod,
        torch_dtype=str(model_dtype(cfg)).removeprefix("torch."),
        **{"hla_" + name: value for name, value in dataclasses.asdict(hla).items()},
    )


# Megatron's names -> the HF model's (a layer's index is kept).
_RENAMES = [
    (r"embedding\.word_embeddings\.weight", "model.embed_tokens.weight"),
    (r"embedding\.position_embeddings\.weight", "model.embed_positions.weight"),
    (r"decoder\.final_layernorm\.(weight|bias)", r"model.norm.\1"),
    (r"decoder\.layers\.(\d+)\.input_layernorm\.(weight|bias)",
     r"model.layers.\1.input_layernorm.\2"),
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.(weight|bias)",
     r"model.layers.\1.attention.qkv.\2"),
    (r"decoder\.layers\.(\d+)\.self_attention\.core_attention\.heads\.(.+)",
     r"model.layers.\1.attention.heads.\2"),
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_proj\.(weight|bias)",
     r"model.layers.\1.attention.proj.\2"),
    (r"decoder\.layers\.(\d+)\.pre_mlp_layernorm\.(weight|bias)",
     r"model.layers.\1.post_attention_layernorm.\2"),
    (r"decoder\.layers\.(\d+)\.mlp\.linear_fc1\.(weight|bias)", r"model.layers.\1.mlp.fc1.\2"),
    (r"decoder\.layers\.(\d+)\.mlp\.linear_fc2\.(weight|bias)", r"model.layers.\1.mlp.fc2.\2"),
]


def _hf_name(name: str) -> str | None:
    for pattern, repl in _RENAMES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, repl, name)
    return None


def hf_state_dict(gpt_model: torch.nn.Module, hf_config: HLASPConfig) -> dict[str, torch.Tensor]:
    """The weights of ``HLASPForCausalLM(hf_config)`` from a single-process GPTModel.

    Every tensor of the GPTModel is placed (Megatron's ``_extra_state`` entries hold
    no weights); one that has no place, or a shape the HF model does not have, is an
    error, so nothing is dropped silently. The embedding keeps its first
    ``hf_config.vocab_size`` rows; the output layer is the embedding (tied), stored
    once under ``model.embed_tokens.weight``.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in gpt_model.state_dict().items():
        if name.endswith("._extra_state"):
            continue
        if name == "output_layer.weight":  # present only when not tied
            raise ConvertError("output_layer.weight: expected the output layer tied to the "
                               "embedding (share_embeddings_and_output_weights), got its own")
        hf = _hf_name(name)
        if hf is None:
            raise ConvertError(f"{name}: a GPTModel tensor the HF model has no place for")
        if hf == "model.embed_tokens.weight":
            if tensor.shape[0] < hf_config.vocab_size:
                raise ConvertError(f"{name}: expected at least vocab_size = "
                                   f"{hf_config.vocab_size} rows, got {tensor.shape[0]}")
            tensor = tensor[: hf_config.vocab_size]  # Megatron's padding rows go
        out[hf] = tensor.detach().clone()
    with torch.device("meta"):
        want = {k: v.shape for k, v in HLASPForCausalLM(hf_config).state_dict().items()
                if k != "lm_head.weight"}
    missing, extra = sorted(set(want) - set(out)), sorted(set(out) - set(want))
    if missing or extra:
        raise ConvertError(
            f"gpt_model: its tensors do not fit hf_config (config and model disagree): "
            f"the HF model's {missing[:4]} are absent, the GPTModel's {extra[:4]} unused")
    for k, shape in want.items():
        if out[k].shape != shape:
            raise ConvertError(f"{k}: the HF model's is {tuple(shape)}, the GPTModel's "
                               f"{tuple(out[k].shape)} (config and model disagree)")
    return out

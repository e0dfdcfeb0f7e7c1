"""Build the megatron-core GPT the trainer trains: HLA core attention, CPU-friendly options.

Choices forced by CPU runs, harmless on GPU:
- on CPU, ``use_cpu_initialization=True``: weights are created whole on the CPU and
  split for tensor parallelism, so the same seed gives the same model at every TP/CP
  size. On CUDA each rank creates only its own shard, on its GPU (Megatron's GPU
  initialisation, seeded per TP rank by its RNG tracker), so a large model never passes
  through host memory, on any of the ranks of a node;
- activation recompute uses ``torch.utils.checkpoint`` (non-reentrant, RNG preserved)
  instead of Megatron's own, whose RNG tracker needs CUDA.
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace
from typing import Any

import torch
from hla_sp.launch.config.train_config import TrainConfig
from hla_sp.launch.distributed.process_groups import tensor_parallel
from hla_sp.launch.model.compiling import compile_layers
from hla_sp.launch.model.estimate import loss_chunk_tokens
from hla_sp.launch.model.loss import install_loss
from hla_sp.megatron_patch.hybrid import assert_hybrid_model, hybrid_block_spec, layer_pattern
from torch.utils.checkpoint import checkpoint


def _megatron_gpt() -> SimpleNamespace:
    """megatron-core's GPT, its local layer spec and TransformerConfig, and the HLA layer
    spec and model check of ``hla_sp.megatron_patch`` (which need it), imported on first
    use: the model subpackage's one import of the megatron extra."""
    from hla_sp.megatron_patch.checks import assert_hla_model
    from hla_sp.megatron_patch.specs import get_hla_layer_local_spec
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    return SimpleNamespace(GPTModel=GPTModel, TransformerConfig=TransformerConfig,
                           get_gpt_layer_local_spec=get_gpt_layer_local_spec,
                           get_hla_layer_local_spec=get_hla_layer_local_spec,
                           assert_hla_model=assert_hla_model)

def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: a multiple of ``divisible_by * tp`` (the model masks the padding
    ids' logits: :func:`hla_sp.megatron_patch.vocab.mask_padded_vocab`)."""
    m = divisible_by * tp
    return (vocab + m - 1) // m * m


def layer_spec(cfg: TrainConfig) -> Any:
    """The transformer layer spec: HLA core attention from ``hla_sp.megatron_patch``."""
    if cfg.model.attention == "softmax":  # Megatron untouched (DotProductAttention needs CUDA)
        return _megatron_gpt().get_gpt_layer_local_spec()
    spec = _megatron_gpt().get_hla_layer_local_spec(cfg.hla)  # the run's HLAConfig, whole
    if cfg.model.hla_layer_pattern is None:
        return spec
    pattern = layer_pattern(cfg.model.hla_layer_pattern, cfg.model.num_layers)
    return hybrid_block_spec(pattern, spec, _megatron_gpt().get_gpt_layer_local_spec())


def softmax_layers(cfg: TrainConfig) -> str | None:
    """The flags that put softmax attention in some layer (``--attention softmax``, or a
    ``--hla-layer-pattern``), as a phrase for an error; None when every layer is HLA."""
    m = cfg.model
    if m.hla_layer_pattern is not None:
        return f"--attention {m.attention} with --hla-layer-pattern {m.hla_layer_pattern!r}"
    return "--attention softmax" if m.attention == "softmax" else None


def model_dtype(cfg: TrainConfig) -> torch.dtype:
    """The dtype of the model's weights and activations (--bf16, --fp16, else fp32)."""
    prec = cfg.precision
    return torch.bfloat16 if prec.bf16 else torch.float16 if prec.fp16 else torch.float32


def transformer_config(cfg: TrainConfig, device: torch.device | None = None) -> Any:
    """megatron-core's TransformerConfig for this run (weights initialised on ``device``
    when it is a CUDA device, else on the CPU)."""
    return _megatron_gpt().TransformerConfig(
        num_layers=cfg.model.num_layers,
        hidden_size=cfg.model.hidden_size,
        num_attention_heads=cfg.model.num_attention_heads,
        num_query_groups=cfg.model.num_query_groups,
        ffn_hidden_size=cfg.model.ffn_hidden_size,
        hidden_dropout=cfg.model.hidden_dropout,
        attention_dropout=cfg.model.attention_dropout,
        init_method_std=cfg.model.init_method_std,
        tensor_model_parallel_size=cfg.parallelism.tensor_model_parallel_size,
        context_parallel_size=cfg.parallelism.context_parallel_size,
        use_cpu_initialization=device is None or device.type != "cuda",
        # --bf16/--fp16: the model's own weights are half; the trainer keeps fp32 masters
        params_dtype=model_dtype(cfg),
        bf16=cfg.precision.bf16,
        fp16=cfg.precision.fp16,
        # fusions need apex/TE or CUDA; the unfused paths are exact and portable
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def _checkpointed(fn: Any, tensor_kwarg: str | None = None) -> Any:
    """``fn`` recomputed in backward by the reentrant ``torch.utils.checkpoint``.

    Reentrant, because the non-reentrant form kept each step's recomputed tensors
    alive under context parallelism (memory grew every iteration; see docs/launch.md).
    Tensor positional arguments (and ``tensor_kwarg`` when given by keyword) are the
    checkpoint's inputs; every other argument is passed through unchanged.
    """

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        lead = (kwargs.pop(tensor_kwarg),) if tensor_kwarg and tensor_kwarg in kwargs else ()
        inputs = (*lead, *args)

        def body(*xs: Any) -> Any:
            if lead:
                return fn(*xs[1:], **{tensor_kwarg: xs[0]}, **kwargs)  # type: ignore[misc]
            return fn(*xs, **kwargs)

        return checkpoint(body, *inputs, use_reentrant=True, preserve_rng_state=True)

    return run


def apply_recompute(model: torch.nn.Module, granularity: str | None) -> int:
    """Recompute each transformer layer (full) or each core attention (selective) in
    backward; returns how many modules were wrapped."""
    if granularity is None:
        return 0
    wrapped = 0
    for layer in model.decoder.layers:
        if granularity == "full":
            layer.forward = _checkpointed(layer.forward, tensor_kwarg="hidden_states")
        else:
            core = layer.self_attention.core_attention
            core.forward = _checkpointed(core.forward)
        wrapped += 1
    return wrapped


def build_model(
    cfg: TrainConfig, vocab_size: int, device: torch.device | None = None
) -> torch.nn.Module:
    """The GPTModel (pre/post process on: no pipeline parallelism), recompute applied;
    on a CUDA ``device`` every weight is created there, not on the host."""
    on_gpu = device is not None and device.type == "cuda"
    if on_gpu:
        # Megatron's GPU initialisation draws from this tracker (one stream per TP rank)
        tensor_parallel().model_parallel_cuda_manual_seed(cfg.optimizer.seed)
    # the default device catches what Megatron does not place itself (the position
    # table, HLA's own parameters)
    with torch.device(device) if on_gpu else contextlib.nullcontext():
        model = _gpt(_megatron_gpt().GPTModel, cfg, vocab_size, device)
    install_loss(model, vocab_size, loss_chunk_tokens(cfg))
    if cfg.performance.compile:  # before recompute, which then wraps the compiled layers

        compile_layers(model)
    granularity = cfg.model.recompute_granularity or (
        "selective" if cfg.model.recompute_activations else None)
    apply_recompute(model, granularity)
    _check_attention(cfg, model)
    return model


def _gpt(gpt: Any, cfg: TrainConfig, vocab_size: int, device: torch.device | None) -> Any:
    return gpt(
        config=transformer_config(cfg, device),
        transformer_layer_spec=layer_spec(cfg),
        vocab_size=padded_vocab_size(
            vocab_size, cfg.model.make_vocab_size_divisible_by,
            cfg.parallelism.tensor_model_parallel_size
        ),
        max_sequence_length=cfg.model.max_position_embeddings or cfg.model.seq_length,
        position_embedding_type=cfg.model.position_embedding_type,
        rotary_percent=cfg.model.rotary_percent,
        rotary_base=cfg.model.rotary_base,
        share_embeddings_and_output_weights=True,
    )


def _check_attention(cfg: TrainConfig, model: torch.nn.Module) -> None:
    """The built model really runs the attention asked for."""
    if cfg.model.hla_layer_pattern is not None:
        assert_hybrid_model(model, layer_pattern(cfg.model.hla_layer_pattern, cfg.model.num_layers),
                            cfg.model.attention)
    elif cfg.model.attention != "softmax":
        _megatron_gpt().assert_hla_model(model, cfg.model.attention)

"""``HLASPModel`` and ``HLASPForCausalLM``: an hla-sp checkpoint as a Hugging Face model.

The forward is megatron-core's GPTModel as the trainer builds it (token embedding plus
learned positions, rope or none; the layers of :mod:`hla_sp.hf.layers`; the final
LayerNorm; the output layer tied to the embedding), with no megatron-core at all. The
vocabulary is the tokenizer's, unpadded: Megatron's padding ids have -inf logits in the
trainer, so dropping them changes no probability.

Decoding carries each layer's recurrent HLA state in ``past_key_values``
(:class:`~hla_sp.hf.cache.HLASPCache`): the prompt is one chunk-parallel forward, every
later token one forward of length 1 whose cost does not depend on the context length.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from hla_sp.hf.cache import HLASPCache
from hla_sp.hf.configuration import HLASPConfig
from hla_sp.hf.layers import SCALED_INIT, HLASPBlock, rope_cos_sin
from hla_sp.nn import HLAHeads

_V5 = int(transformers.__version__.split(".")[0]) >= 5


def _check_mask(attention_mask: torch.Tensor | None) -> None:
    """HLA's state has no notion of padding: a mask must keep every token."""
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError(
            "attention_mask: expected all ones (an HLA state has no padding; run sequences of "
            "different lengths one at a time), got zeros at "
            f"{(attention_mask == 0).nonzero()[:4].tolist()}")


class HLASPPreTrainedModel(PreTrainedModel):
    """Weight initialisation and the class attributes ``transformers`` reads."""

    config_class = HLASPConfig
    base_model_prefix = "model"
    _no_split_modules = ["HLASPBlock"]  # noqa: RUF012 (transformers' own convention)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # the cache is HLASPCache, made by the model itself (not a per-token KV cache)
        return False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Megatron's initialisation: normal(0, std) weights (the output projections'
        std divided by sqrt(2 x layers)), zero biases, unit norms, HLA's own reset."""
        std = self.config.initializer_range
        if isinstance(module, HLAHeads):
            # reset_parameters sets every HLA parameter at once: put back those loaded
            loaded = {n: p.detach().clone() for n, p in module.named_parameters()
                      if getattr(p, "_is_hf_initialized", False)}
            module.reset_parameters()
            for n, p in module.named_parameters():
                if n in loaded:
                    p.copy_(loaded[n])
        elif isinstance(module, nn.Linear | nn.Embedding):
            scaled = getattr(module, SCALED_INIT, False)
            s = std / (2 * self.config.num_hidden_layers) ** 0.5 if scaled else std
            _init("normal_", module.weight, mean=0.0, std=s)
            if getattr(module, "bias", None) is not None:
                _init("zeros_", module.bias)
        elif isinstance(module, nn.LayerNorm):
            _init("ones_", module.weight)
            _init("zeros_", module.bias)


def _init(fn: str, t: torch.Tensor, **kw: Any) -> None:
    """transformers 5's initialisers skip a tensor already loaded; torch's otherwise."""
    if _V5:
        from transformers import initialization

        getattr(initialization, fn)(t, **kw)
    elif not getattr(t, "_is_hf_initialized", False):
        getattr(nn.init, fn)(t, **kw)


class HLASPModel(HLASPPreTrainedModel):
    """Embeddings, HLA transformer layers and the final LayerNorm: hidden states."""

    def __init__(self, config: HLASPConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size)
            if config.position_embedding_type == "learned_absolute" else None)
        self.layers = nn.ModuleList(HLASPBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: HLASPCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        """input_ids [B, T] (or inputs_embeds [B, T, hidden], the token embeddings) after
        the tokens ``past_key_values`` has seen -> last_hidden_state [B, T, hidden], and
        with ``use_cache`` the cache (the one given, advanced, or a new one)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("input_ids, inputs_embeds: expected exactly one of them, got "
                             f"{'both' if input_ids is not None else 'neither'}")
        _check_mask(attention_mask)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if past_key_values is not None and not isinstance(past_key_values, HLASPCache):
            raise TypeError(f"past_key_values: expected an HLASPCache (or None), got "
                            f"{type(past_key_values).__name__}")
        if use_cache and past_key_values is None:
            past_key_values = HLASPCache(self.config.num_hidden_layers)
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        T = x.shape[1]
        start = 0 if past_key_values is None else past_key_values.seen
        rope = None
        if self.embed_positions is not None:
            limit = self.config.max_position_embeddings
            if start + T > limit:
                raise ValueError(f"input_ids: positions {start}..{start + T - 1} exceed the "
                                 f"model's {limit} learned positions (max_position_embeddings)")
            x = x + self.embed_positions(torch.arange(start, start + T, device=x.device))[None]
        elif self.config.position_embedding_type == "rope":
            rope = rope_cos_sin(self.config, start, T, x.device)
        hidden: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if output_hidden_states:
                hidden.append(x)
            state = None if past_key_values is None else past_key_values.states[i]
            x, state = layer(x, rope, state, want_state=past_key_values is not None)
            if past_key_values is not None:
                past_key_values.states[i] = state
        x = self.norm(x)
        if output_hidden_states:
            hidden.append(x)
        if past_key_values is not None:
            past_key_values.seen += T
        return BaseModelOutputWithPast(
            last_hidden_state=x, past_key_values=past_key_values if use_cache else None,
            hidden_states=tuple(hidden) if output_hidden_states else None)


class HLASPForCausalLM(HLASPPreTrainedModel, GenerationMixin):
    """:class:`HLASPModel` and the output layer, tied to the token embedding."""

    _tied_weights_keys = (
        {"lm_head.weight": "model.embed_tokens.weight"} if _V5 else ["lm_head.weight"])

    def __init__(self, config: HLASPConfig):
        super().__init__(config)
        self.model = HLASPModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        past_key_values: HLASPCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Logits [B, T, vocab] of the tokens after those ``past_key_values`` has seen;
        with ``labels`` [B, T] the mean cross-entropy of predicting labels[:, t + 1]
        from position t (-100: ignored)."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                         use_cache=use_cache, output_hidden_states=output_hidden_states)
        logits = self.lm_head(out.last_hidden_state)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                   labels[:, 1:].flatten().to(logits.device), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits,
                                      past_key_values=out.past_key_values,
                                      hidden_states=out.hidden_states)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        past_key_values: HLASPCache | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The next forward's inputs: the whole prompt first, then only the tokens the
        cache has not seen (one per step), since the states hold everything before."""
        seen = 0 if past_key_values is None else past_key_values.seen
        inputs: dict[str, Any] = {"past_key_values": past_key_values, "use_cache": use_cache,
                                  "attention_mask": attention_mask}
        if inputs_embeds is not None and seen == 0:
            inputs["inputs_embeds"] = inputs_embeds
        else:
            inputs["input_ids"] = input_ids[:, seen:]
        return inputs

"""``HLASPCache``: what an hla-sp model carries from one forward to the next while decoding.

Each HLA layer's recurrent state (:meth:`hla_sp.nn.HLAHeads.init_state` describes it: the
operator's state tuple, in a ``LayerState`` with the short convolution's last inputs)
and how many tokens the states have seen, which is the position of the next token.
Its size does not grow with the context: a decode step costs the same at any length.

It is not a ``transformers.Cache`` (those hold keys and values per token); the model
tells ``generate()`` so (``_supports_default_dynamic_cache`` is False), creates one on
its first forward and returns it in ``past_key_values``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _map_state(state: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to every tensor of a (nested, named) state tuple; None stays None."""
    if state is None:
        return None
    if isinstance(state, torch.Tensor):
        return fn(state)
    parts = [_map_state(s, fn) for s in state]
    return type(state)(*parts) if hasattr(state, "_fields") else type(state)(parts)


class HLASPCache:
    """Per-layer HLA states and the number of tokens they have seen.

    Args:
        num_layers: one state slot per layer (None until the layer's first forward).
    """

    # generate() asks these of a cache; the states have fixed shapes but are replaced,
    # not written in place, so the cache is neither compiled nor cropped.
    is_compileable = False
    is_croppable = False

    def __init__(self, num_layers: int):
        self.states: list[Any] = [None] * num_layers
        self.seen = 0

    def __len__(self) -> int:
        return len(self.states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far (the position of the next one)."""
        return self.seen

    def _select(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.states = [_map_state(s, fn) for s in self.states]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep the batch rows ``beam_idx`` [N] (beam search), in that order."""
        self._select(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the batch rows ``indices``."""
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row ``repeats`` times (beams, num_return_sequences)."""
        self._select(lambda x: x.repeat_interleave(repeats, dim=0))

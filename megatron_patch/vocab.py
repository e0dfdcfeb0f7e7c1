"""Padded vocabulary rows take no probability.

Megatron pads the vocabulary to a multiple of ``--make-vocab-size-divisible-by`` x TP, so
the same data gives 384 rows at TP 1 and 512 at TP 2 (257 ids, divisor 128). Unmasked,
the padding ids take part in the softmax: the loss depends on how many there are and on
their (untrained, or after resharding zeroed) rows, and a sampler may draw them.

:func:`mask_padded_vocab` sets the output logits at ids >= the true vocabulary to -inf in
the model itself (a forward hook on GPTModel's output layer), before the loss and before
anyone samples, so training, evaluation, generation and export all see the same
distribution over the real ids, whatever the padding. Under tensor parallelism the
logits are vocabulary-parallel: each rank masks the ids of its slice that are padding.
exp(-inf) is exactly 0, so the loss over the real ids is the unpadded one and the padding
rows get no gradient from it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def padding_columns(vocab_size: int, first_id: int, width: int) -> int:
    """Index, in a slice of ``width`` logits holding ids ``first_id...``, of the first
    padding id (``width``: none in this slice)."""
    return min(width, max(0, vocab_size - first_id))


class PaddedVocabMask:
    """The forward hook of a vocabulary-parallel output layer: -inf at padding ids."""

    def __init__(self, layer: Any, vocab_size: int):
        self.vocab_size = vocab_size
        self.full = int(layer.output_size)
        self.per_rank = int(getattr(layer, "output_size_per_partition", self.full))
        self.rank = 0
        if self.per_rank != self.full:  # split over the TP group: this rank's slice
            group = getattr(layer, "tp_group", None)
            if group is None:  # a megatron-core without the layer's own group
                from megatron.core import parallel_state

                self.rank = parallel_state.get_tensor_model_parallel_rank()
            else:
                self.rank = torch.distributed.get_rank(group)

    def __call__(self, module: Any, args: Any, output: Any) -> Any:
        logits: Tensor = output[0] if isinstance(output, tuple) else output
        width = logits.shape[-1]
        # gathered (gather_output, or a runtime gather for inference): the whole vocabulary
        first = 0 if width == self.full else self.rank * self.per_rank
        cut = padding_columns(self.vocab_size, first, width)
        if cut < width:
            # in place: the output of a linear layer, which its backward does not read
            logits.narrow(-1, cut, width - cut).fill_(float("-inf"))
        return output


def mask_padded_vocab(model: torch.nn.Module, vocab_size: int) -> int:
    """Mask the padding ids of every GPTModel output layer in ``model`` (wrappers such as
    DDP included); returns how many layers were hooked (0: no output layer here, e.g. a
    pipeline stage before the last). Idempotent."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size: expected an int >= 1 (the true vocabulary), "
                         f"got {vocab_size!r}")
    hooked = 0
    for m in model.modules():
        layer = getattr(m, "output_layer", None)
        if layer is None or not hasattr(layer, "output_size"):
            continue
        held = getattr(layer, "_hla_vocab_mask", None)
        if held is not None:
            held[0].vocab_size = vocab_size
        else:
            if vocab_size > layer.output_size:
                raise ValueError(f"vocab_size: expected at most the output layer's "
                                 f"{layer.output_size} ids, got {vocab_size}")
            hook = PaddedVocabMask(layer, vocab_size)
            layer._hla_vocab_mask = (hook, layer.register_forward_hook(hook))
        hooked += 1
    return hooked

"""The training loss, owned here: what the model returns for a batch, and its reduction.

:func:`install_loss` is the one place the model's loss is set up (by
:func:`~hla_sp.launch.model.build.build_model`): padding ids take no probability
(:func:`hla_sp.megatron_patch.vocab.mask_padded_vocab`), and with ``--loss-chunk-tokens``
the loss is computed over sequence chunks. :func:`token_losses` is the one call that
asks the model for per-token losses (the trainer's step and evaluation, ``hla-sp eval``)
and :func:`masked_loss_sum` the one reduction of them. Megatron-core has no public seam
between the final norm and the output layer, so the chunked path wraps GPTModel's
``_postprocess`` (with labels only); its vocabulary slice is computed here from the
output layer, not read from another module's attribute.

Output projection and cross-entropy over sequence chunks: never all logits at once.

The plain path (GPTModel's output layer, then ``vocab_parallel_cross_entropy``) holds
fp32 logits, their softmax and its gradient for every token of the rank: 12 bytes per
token per vocabulary entry of the TP rank, most of the activation memory at long
context with a real vocabulary. :class:`ChunkedLinearCrossEntropy` computes the same
per-token losses ``chunk`` tokens at a time and keeps only each token's log-sum-exp;
backward recomputes each chunk's logits (one more output matmul, forward only) to form
``softmax - onehot`` and accumulates the weight's gradient chunk by chunk.

Under tensor parallelism the vocabulary is split as in Megatron (rank r holds ids
``r * V_local ...``): the log-sum-exp is all-reduced over the TP group (max, then the sum
of exponentials together with the target's logit), and the hidden states enter through
``copy_to_tensor_model_parallel_region``, whose backward all-reduces their gradient as
ColumnParallelLinear's does. Padding ids (>= the true vocabulary) get -inf logits, as
:func:`hla_sp.megatron_patch.vocab.mask_padded_vocab` gives the plain path.

:func:`use_chunked_loss` installs it in a GPTModel: a call with labels returns the
chunked per-token losses [b, s]; without labels (generation, evaluation of logits,
export) the model returns logits exactly as before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from hla_sp.launch.distributed.process_groups import parallel_state, tensor_parallel
from hla_sp.megatron_patch.vocab import PaddedVocabMask, mask_padded_vocab, padding_columns
from torch import Tensor

__all__ = ["ChunkedLinearCrossEntropy", "chunked_cross_entropy", "install_loss",
           "masked_loss_sum", "token_losses", "use_chunked_loss"]


def install_loss(model: torch.nn.Module, vocab_size: int, chunk: int | None) -> None:
    """Set up ``model``'s loss: the padded ids (>= ``vocab_size``) masked, so the loss
    does not depend on the padding (--make-vocab-size-divisible-by x TP) nor on what
    resharding put in those rows; and with ``chunk`` tokens (--loss-chunk-tokens), the
    loss without all logits at once."""
    mask_padded_vocab(model, vocab_size)
    if chunk:
        use_chunked_loss(model, chunk, vocab_size)


def token_losses(model: torch.nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Per-token losses [b, s_local] (fp32) of a batch of ``tokens``, ``position_ids`` and
    ``labels`` [b, s_local]: the model called with labels."""
    return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])


def masked_loss_sum(per_token: Tensor, loss_mask: Tensor) -> Tensor:
    """The sum of the per-token losses [b, s] where ``loss_mask`` [b, s] is 1 (fp32);
    divided by the global count of such tokens, it is the token-mean loss."""
    return (per_token.float() * loss_mask).sum()


def _chunk_logits(h: Tensor, weight: Tensor, pad_from: int) -> Tensor:
    """Logits [n, V_local] of ``h`` [n, h] in fp32 (fp64 for fp64 inputs), padding columns
    at -inf. The matmul runs in the model's dtype and is then widened, as the plain
    path's output layer and cross-entropy do, so both round alike."""
    logits = h @ weight.t()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if pad_from < logits.shape[1]:
        logits[:, pad_from:] = float("-inf")
    return logits


def _local_targets(labels: Tensor, first: int, width: int) -> tuple[Tensor, Tensor]:
    """(index into this rank's slice [n], mask [n] of labels outside it)."""
    outside = (labels < first) | (labels >= first + width)
    return (labels - first).masked_fill(outside, 0), outside


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy [n] (fp32; fp64 for fp64 inputs) of ``hidden`` [n, h] x
    ``weight`` [V_local, h]^T against ``labels`` [n], ``chunk`` tokens at a time;
    ``first`` is this rank's first vocabulary id, ``pad_from`` the first padding column
    of its slice, ``group`` the TP group (None: the whole vocabulary is here)."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, labels: Tensor, chunk: int,
                first: int, pad_from: int, group: Any) -> Tensor:
        n = hidden.shape[0]
        wide = torch.promote_types(hidden.dtype, torch.float32)
        lse = torch.empty(n, dtype=wide, device=hidden.device)
        loss = torch.empty_like(lse)
        for a in range(0, n, chunk):
            logits = _chunk_logits(hidden[a:a + chunk], weight, pad_from)
            idx, outside = _local_targets(labels[a:a + chunk], first, logits.shape[1])
            top = logits.max(dim=1).values
            if group is not None:
                dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            target = logits.gather(1, idx[:, None])[:, 0].masked_fill(outside, 0.0)
            # one all-reduce for both sums: the exponentials and the target's logit
            sums = torch.stack([logits.sub_(top[:, None]).exp_().sum(dim=1), target])
            if group is not None:
                dist.all_reduce(sums, group=group)
            lse[a:a + chunk] = sums[0].log() + top
            loss[a:a + chunk] = lse[a:a + chunk] - sums[1]
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk, ctx.first, ctx.pad_from = chunk, first, pad_from
        return loss

    @staticmethod
    def backward(ctx: Any, dloss: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, labels, lse = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.empty_like(hidden) if want_h else None
        # fp32 across chunks, rounded to the weight's dtype once at the end
        wide = torch.promote_types(weight.dtype, torch.float32)
        dw = torch.zeros(weight.shape, dtype=wide, device=weight.device) if want_w else None
        for a in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[a:a + ctx.chunk]
            grad = _chunk_logits(h, weight, ctx.pad_from)
            grad.sub_(lse[a:a + ctx.chunk, None]).exp_()  # softmax over the whole vocabulary
            idx, outside = _local_targets(labels[a:a + ctx.chunk], ctx.first, grad.shape[1])
            grad.scatter_add_(1, idx[:, None], -(~outside).to(grad.dtype)[:, None])
            grad = grad.mul_(dloss[a:a + ctx.chunk, None]).to(hidden.dtype)
            if dh is not None:
                dh[a:a + ctx.chunk] = grad @ weight
            if dw is not None:
                dw += grad.t() @ h
        return dh, None if dw is None else dw.to(weight.dtype), None, None, None, None, None


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, chunk: int,
                          vocab_size: int, rank: int = 0, group: Any = None) -> Tensor:
    """Per-token losses [b, s] (fp32; fp64 for fp64 inputs) of final hidden states
    ``hidden`` [s, b, h] with the output ``weight`` [V_local, h] (rank ``rank``'s slice
    of the padded vocabulary over ``group``; ids >= ``vocab_size`` are padding) against
    ``labels`` [b, s]."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk: expected an int >= 1 (tokens per chunk), got {chunk!r}")
    if hidden.dim() != 3 or weight.dim() != 2 or hidden.shape[2] != weight.shape[1]:
        raise ValueError(f"hidden, weight: expected [s, b, h] and [V_local, h], got "
                         f"{list(hidden.shape)} and {list(weight.shape)}")
    s, b, width = hidden.shape
    if list(labels.shape) != [b, s]:
        raise ValueError(f"labels: expected shape [b, s] = {[b, s]}, got {list(labels.shape)}")
    if group is not None and dist.get_world_size(group) > 1:
        hidden = tensor_parallel().copy_to_tensor_model_parallel_region(hidden, group=group)
    else:
        group = None
    first = rank * weight.shape[0]
    pad_from = padding_columns(vocab_size, first, weight.shape[0])
    # tokens in [s, b] order, as the hidden states lie: no copy of the activations
    loss = ChunkedLinearCrossEntropy.apply(
        hidden.reshape(s * b, width), weight, labels.t().reshape(s * b), chunk, first,
        pad_from, group)
    return loss.view(s, b).t().contiguous()


def use_chunked_loss(model: torch.nn.Module, chunk: int, vocab_size: int) -> int:
    """Make every GPTModel in ``model`` compute its loss with :func:`chunked_cross_entropy`,
    ``chunk`` tokens at a time, when called with labels, ids >= ``vocab_size`` being
    padding; returns how many were changed."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk: expected an int >= 1 (tokens per chunk), got {chunk!r}")
    changed = 0
    for m in model.modules():
        layer = getattr(m, "output_layer", None)
        if layer is None or not hasattr(m, "_postprocess"):
            continue
        if getattr(layer, "sequence_parallel", False):
            raise ValueError("use_chunked_loss: expected sequence_parallel=False (the "
                             "hidden states whole on each TP rank), got True")
        # this rank's slice of the padded vocabulary, as the padding mask sees it
        m._postprocess = _ChunkedPost(m, m._postprocess, chunk,
                                      PaddedVocabMask(layer, vocab_size))
        changed += 1
    return changed


class _ChunkedPost:
    """GPTModel._postprocess with labels through the chunked loss; everything else
    (no labels, multi-token prediction, inference) through megatron's own."""

    def __init__(self, gpt: Any, original: Any, chunk: int, vocab: PaddedVocabMask):
        self.gpt, self.original, self.chunk, self.vocab = gpt, original, chunk, vocab

    def __call__(self, **kw: Any) -> Tensor:
        gpt = self.gpt
        if kw.get("labels") is None or kw.get("mtp_in_postprocess") \
                or kw.get("inference_context") is not None:
            return self.original(**kw)
        layer = gpt.output_layer
        weight = gpt.shared_embedding_or_output_weight() \
            if gpt.share_embeddings_and_output_weights else layer.weight
        vocab, group = self.vocab, None
        if vocab.per_rank != vocab.full:
            group = getattr(layer, "tp_group", None)
            if group is None:  # a megatron-core without the layer's own group
                group = parallel_state().get_tensor_model_parallel_group()
        return chunked_cross_entropy(kw["hidden_states"], weight, kw["labels"], self.chunk,
                                     vocab.vocab_size, vocab.rank, group)

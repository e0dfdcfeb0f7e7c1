"""``torch.vmap`` rules of the chunk operators (:mod:`hla_sp.ops.chunk_op`).

``torch.vmap`` over a model (stacked weights, e.g. many seeds trained in one process)
reaches the operators with a vmapped dimension. Without a rule vmap would run them once
per problem; with these, each operator runs once on all of the problems, folded into
its batch. Autograd records that one call, so a backward outside vmap runs one backward
call too. Registered when :mod:`hla_sp.ops` is imported.
"""

from __future__ import annotations

from typing import Any

import torch

from hla_sp.ops.chunk_op import chunk_linear_attention_bwd_op, chunk_linear_attention_op

Tensor = torch.Tensor


def _fold_vmap(info: Any, in_dims: tuple[Any, ...], args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The arguments of a call under ``torch.vmap`` with the vmapped dimension folded
    into the batch: each tensor [N, B, ...] (its vmapped dimension moved first, a tensor
    that is not vmapped broadcast to N) becomes [N B, ...]. Every tensor argument of
    both operators leads with B, so the N problems are one call of N B sequences."""
    out = []
    for x, d in zip(args, in_dims, strict=True):
        if isinstance(x, Tensor):
            x = x.movedim(d, 0) if d is not None else x.expand(info.batch_size, *x.shape)
            x = x.reshape(-1, *x.shape[2:])
        out.append(x)
    return tuple(out)


def _unfold(n: int, outputs: tuple[Tensor, ...]) -> tuple[tuple[Tensor, ...], tuple[Any, ...]]:
    """Outputs [N B, ...] as [N, B, ...] (vmapped at 0); empty placeholders (an absent
    gradient) stay as they are, not vmapped."""
    views = tuple(o if o.numel() == 0 and o.dim() == 1 else o.reshape(n, -1, *o.shape[1:])
                  for o in outputs)
    dims = tuple(None if o.numel() == 0 and o.dim() == 1 else 0 for o in outputs)
    return views, dims


@chunk_linear_attention_op.register_vmap
def _(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
    return _unfold(info.batch_size, chunk_linear_attention_op(*_fold_vmap(info, in_dims, args)))


@chunk_linear_attention_bwd_op.register_vmap
def _(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
    return _unfold(info.batch_size,
                   chunk_linear_attention_bwd_op(*_fold_vmap(info, in_dims, args)))

"""Megatron's ``--reset-attention-mask`` for HLA: the packed documents, from the EOD tokens.

Megatron's GPT dataset packs documents into one sample, each ending with an EOD token.
``--reset-attention-mask`` asks that no token attend across an EOD; softmax layers get
that from the dataloader's ``[b, 1, s, s]`` mask, which HLA (causal by construction)
does not read. Here the same cut is made exactly as packed documents are: a document
starts after every EOD (Megatron's ``_get_ltor_masks_and_position_ids``), each row's
offsets go to the HLA layers as ``cu_seqlens``, and every layer's state restarts at
each offset (short convolution included).

:class:`DocumentParams` carries the offsets through megatron-core's GPTModel in its
``packed_seq_params`` slot (format ``sbhd``: megatron-core handles the batch as usual and
only HLA reads the offsets). It is built once per micro-batch, from the whole rows,
before the context-parallel split (the offsets are global; documents may cross ranks),
and it caches the per-row batch plans, so that the first HLA layer plans the batch and
the others, and activation recomputation, reuse the plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor


def eod_offsets(tokens: Tensor, eod: int) -> list[Tensor]:
    """Per row of ``tokens`` [b, s]: the documents' offsets ``[0, ..., s]`` (int64, on the
    host), a document starting after each EOD as in Megatron's attention-mask reset."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens: expected [b, s], got shape {tuple(tokens.shape)}")
    s = tokens.shape[1]
    # one host read per micro-batch: the EOD positions of every row
    rows, cols = torch.nonzero(tokens == eod, as_tuple=True)
    rows, cols = rows.tolist(), cols.tolist()
    starts: list[list[int]] = [[0] for _ in range(tokens.shape[0])]
    for r, c in zip(rows, cols):
        if c + 1 < s:  # an EOD as the last token starts nothing inside this row
            starts[r].append(c + 1)
    return [torch.tensor([*st, s], dtype=torch.int64) for st in starts]


@dataclasses.dataclass
class DocumentParams(PackedSeqParams):
    """The documents of a ``[b, s]`` micro-batch for the HLA layers (``qkv_format`` sbhd).

    ``row_offsets[i]`` holds row i's document offsets over the whole row (before any
    context-parallel split). Plans are cached per (row, local length, SequenceParallel).
    """

    row_offsets: tuple[Tensor, ...] = ()
    _plans: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_tokens(cls, tokens: Tensor, eod: int) -> DocumentParams:
        """The documents of ``tokens`` [b, s] (the whole rows: before the CP split)."""
        s = tokens.shape[1]
        # megatron-core sizes RoPE by max_seqlen when packed params are given: the whole
        # row, as it would without them (the local length times the CP size)
        return cls(qkv_format="sbhd", max_seqlen_q=s, max_seqlen_kv=s,
                   row_offsets=tuple(eod_offsets(tokens, eod)))

    def plan(self, key: Any, T_local: int, sp: Any, offsets: Tensor) -> Any:
        """The BatchPlan of ``offsets`` at ``T_local`` tokens on this rank, built once."""
        facts = (key, T_local, id(sp))
        if facts not in self._plans:
            if sp is None:
                from hla_sp.ops.sharding import plan_documents

                self._plans[facts] = plan_documents(offsets, T_local)
            else:
                self._plans[facts] = sp.plan_batch(T_local, offsets)
        return self._plans[facts]

    def joined(self, T: int) -> Tensor:
        """The rows' offsets as one sequence of ``len(rows) * T`` tokens (one process: the
        rows laid end to end, each row's end a document end)."""
        parts = [off[:-1] + i * T for i, off in enumerate(self.row_offsets)]
        return torch.cat([*parts, torch.tensor([len(self.row_offsets) * T])])

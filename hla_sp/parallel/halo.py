"""The halo of a short causal convolution across ranks: each piece's last tokens.

A causal convolution with W taps at a piece's first W-1 positions reads the W-1 global
positions before the piece, which other ranks hold (one rank for contiguous shards,
more when shards are shorter than W-1 or empty; under zigzag, the neighbouring chunk).
Every rank sends the last min(W-1, length) tokens of each of its pieces, right-aligned
in a [slots, B, W-1, C] block, and one all-gather gives every rank every piece's tail.
:func:`tail_rows` says where a global position lives in that gathered block.

The backward is the mirror: the gradient of the gathered block is summed over ranks
(one all-reduce) and each rank keeps the part of its own tails. Like every collective
of a call, it is chained on the call's ordering token (:mod:`hla_sp.parallel.exchange`),
so every rank runs it in backward, whether or not its outputs read any halo.
"""

from __future__ import annotations

import torch

from hla_sp.parallel.comm import all_gather_single, count, size_bytes
from hla_sp.parallel.exchange import chain_of, summed, traced_gather
from hla_sp.parallel.plan import Plan


def slots(plan: Plan) -> int:
    """Pieces per rank: 1 (contiguous) or 2 (zigzag)."""
    return max(p.slot for p in plan.pieces) + 1


def own_tails(plan: Plan, x: torch.Tensor, width: int) -> torch.Tensor:
    """This rank's tails: x [B, T_local, C] -> [slots, B, width, C], right-aligned, zeros
    where a piece is shorter than ``width``."""
    B, _, C = x.shape
    out = x.new_zeros(slots(plan), B, width, C)
    for p in plan.own:
        n = min(width, p.length)
        if n:
            out[p.slot, :, width - n :] = x[:, p.local_offset + p.length - n : p.local_offset
                                            + p.length]
    return out


def tail_rows(plan: Plan, pos: torch.Tensor, width: int) -> torch.Tensor:
    """Rows of global positions ``pos`` (int64, any shape) in the gathered block flattened
    over (rank, slot, tail position). Each position must lie in the last ``width`` tokens
    of its piece, as the W-1 positions before any piece do."""
    n_slots = slots(plan)
    full = [p for p in plan.pieces if p.length]
    ends = torch.tensor([p.end for p in full], dtype=torch.long)
    which = torch.searchsorted(ends, pos, right=True).clamp(max=len(full) - 1)
    base = torch.tensor([(p.owner * n_slots + p.slot) * width for p in full], dtype=torch.long)
    return base[which] + width - (ends[which] - pos)


class _GatherTails(torch.autograd.Function):
    """(token, tails [slots, B, W, C]) -> (token, gathered [P, slots, B, W, C])."""

    @staticmethod
    def forward(ctx, token, tails, plan):
        ctx.plan = plan.for_backward()
        P = plan.world_size
        flat = tails.detach().contiguous().reshape(-1)
        out = flat.new_empty(P * flat.numel())
        if P == 1:
            out.copy_(flat)
        else:
            all_gather_single(out, flat, group=plan.group)
            count("halo", (P - 1) * size_bytes(flat))
        return token.new_zeros(()), out.view(P, *tails.shape)

    @staticmethod
    def backward(ctx, d_token, d_gathered):
        # Every rank read some of every rank's tails: the gradient of my tails is the
        # sum over ranks of what each read from them.
        g = summed(ctx.plan, d_gathered, "halo_grad")
        return torch.zeros((), dtype=torch.float32), g[ctx.plan.rank], None


def gather_tails(plan: Plan, tails: torch.Tensor) -> torch.Tensor:
    """Every rank's tails [P, slots, B, W, C], ordered by the call's token (under
    torch.compile: one functional all-gather on the same token chain)."""
    if torch.compiler.is_compiling():
        return traced_gather(plan, tails)
    chain = chain_of(plan)
    chain.token, out = _GatherTails.apply(chain.token, tails, plan)
    return out

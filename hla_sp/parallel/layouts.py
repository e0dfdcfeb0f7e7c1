"""How the global sequence is cut into pieces and which rank holds which piece.

A *piece* is a contiguous run of global positions held by one rank. The fold of
the segment summaries follows the global order of the pieces (index ``m``):

- contiguous: rank r holds piece m = r; lengths may differ, a piece may be empty;
- zigzag (Megatron's load-balanced context parallelism): the sequence is cut into
  2P equal chunks and rank r holds chunks r and 2P-1-r, concatenated in that order,
  so each rank holds two pieces (slots 0 and 1) and M = 2P.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Piece:
    """One contiguous run of the global sequence held by one rank."""

    m: int  # index in global order
    owner: int  # group rank that holds it
    slot: int  # position among the owner's pieces (its order inside the local shard)
    start: int  # first global position
    length: int  # number of tokens (may be 0)
    local_offset: int  # where it begins inside the owner's local shard

    @property
    def end(self) -> int:
        return self.start + self.length


def layout_pieces(layout: str, lengths: list[int]) -> list[Piece]:
    """All pieces of the global sequence, in global order.

    Args:
        layout: "contiguous" or "zigzag".
        lengths: the local shard length of every rank, in group rank order.
    """
    P = len(lengths)
    if layout == "contiguous":
        pieces, start = [], 0
        for r, n in enumerate(lengths):
            pieces.append(Piece(r, r, 0, start, n, 0))
            start += n
        return pieces
    if layout == "zigzag":
        if len(set(lengths)) != 1 or lengths[0] % 2:
            raise ValueError(
                f"zigzag layout: expected the same even local length on every rank, got {lengths}"
            )
        C = lengths[0] // 2
        out = []
        for m in range(2 * P):
            owner, slot = (m, 0) if m < P else (2 * P - 1 - m, 1)
            out.append(Piece(m, owner, slot, m * C, C, slot * C))
        return out
    raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")


def split_lengths(T: int, world_size: int, layout: str) -> list[int]:
    """Default local lengths: zigzag needs T divisible by 2P; contiguous spreads the rest."""
    if layout == "zigzag":
        if T % (2 * world_size):
            raise ValueError(f"T: expected a multiple of 2P = {2 * world_size} for zigzag, got {T}")
        return [T // world_size] * world_size
    base, extra = divmod(T, world_size)
    return [base + (r < extra) for r in range(world_size)]


def shard(
    x: torch.Tensor,
    rank: int,
    world_size: int,
    layout: str = "contiguous",
    *,
    lengths: list[int] | None = None,
    dim: int = 1,
) -> torch.Tensor:
    """This rank's shard of a global tensor along ``dim`` (a copy-free slice or a cat).

    Args:
        x: a global tensor, e.g. [B, T, H, K].
        lengths: local lengths per rank (contiguous only); default :func:`split_lengths`.
    """
    T = x.shape[dim]
    lengths = split_lengths(T, world_size, layout) if lengths is None else list(lengths)
    if len(lengths) != world_size or sum(lengths) != T:
        raise ValueError(
            f"lengths: expected {world_size} lengths summing to T = {T}, got {lengths}"
        )
    mine = [p for p in layout_pieces(layout, lengths) if p.owner == rank]
    mine.sort(key=lambda p: p.slot)
    parts = [x.narrow(dim, p.start, p.length) for p in mine]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def positions(rank: int, world_size: int, layout: str, lengths: list[int]) -> torch.Tensor:
    """Global positions of this rank's shard, in local order ([T_local] int64)."""
    mine = sorted((p for p in layout_pieces(layout, lengths) if p.owner == rank),
                  key=lambda p: p.slot)
    return torch.cat([torch.arange(p.start, p.end) for p in mine])


def call_problems(layout: str, lengths: tuple[int, ...],
                  bounds: tuple[int, ...] | None) -> list[str]:
    """What is wrong with a call the ranks agree on: every rank's local length under
    ``layout`` and the global document offsets (the same text on every rank)."""
    problems = []
    P, total = len(lengths), sum(lengths)
    if bounds is not None and bounds[-1] != total:
        problems.append(
            f"cu_seqlens[-1] = {bounds[-1]} but the local lengths {list(lengths)} "
            f"(ranks 0..{P - 1}) sum to {total}"
        )
    if total == 0:
        problems.append("every rank's shard is empty (global T = 0)")
    if layout == "zigzag" and (len(set(lengths)) != 1 or lengths[0] % 2):
        problems.append(
            f"zigzag layout needs the same even local T on every rank, got {list(lengths)}"
        )
    return problems

"""The plan of one checked call: what every rank knows after the agreement check.

:meth:`hla_sp.parallel.SequenceParallel.check_call` returns a :class:`Plan`; the stages
of the call carry it (the compositions' stage closures) and pass it to every
primitive stage, so nothing of a call is left on the long-lived ``SequenceParallel``.
A plan is frozen: the document offsets are converted to Python ints once, here. The
one thing that changes during a call is the ordering token of its collectives, held in
the plan's :class:`Chain` (see :mod:`hla_sp.parallel.exchange`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hla_sp.config import SP_METHODS
from hla_sp.parallel.layouts import Piece

# The exchanges of summaries a call can use (SequenceParallel.method, Plan.method): the
# names of the exchange table (hla_sp.parallel.exchange.EXCHANGES), defined once in
# hla_sp.config. Not the table itself: exchange.py imports this module.
METHODS: tuple[str, ...] = SP_METHODS


class Chain:
    """The latest ordering token of one call's collectives (mutable, shared by its stages)."""

    def __init__(self, token: torch.Tensor) -> None:
        self.token = token


@dataclass(frozen=True)
class Plan:
    """One public call, as every rank of the group agreed on it."""

    rank: int
    world_size: int
    group: dist.ProcessGroup
    method: str  # one of METHODS
    overlap: bool  # compute the local outputs while the exchange is in flight
    lengths: tuple[int, ...]  # local T of every rank
    pieces: tuple[Piece, ...]  # every piece, in global order
    T: int  # global sequence length
    bounds: tuple[int, ...] | None  # global document offsets (cu_seqlens), or None
    needs_grad: bool  # grad mode is on: every rank builds the backward collectives
    chain: Chain | None  # orders this call's collectives in backward (exchange.py)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {self.method!r}")

    def for_backward(self) -> Plan:
        """This plan without its chain, for an autograd context to keep.

        A context holding the token would close a cycle (plan -> token -> grad_fn ->
        context -> plan) through autograd nodes, which Python's collector cannot see:
        every call's graph and saved tensors would leak.
        """
        return dataclasses.replace(self, chain=None)

    @property
    def own(self) -> list[Piece]:
        """This rank's pieces in local (slot) order (a property, not a cached one:
        dynamo cannot trace cached_property's lock, and there are at most 2P pieces)."""
        return sorted((p for p in self.pieces if p.owner == self.rank), key=lambda p: p.slot)

    @property
    def starts(self) -> list[int]:
        """Global document starts (one document [0, T) without offsets)."""
        return [0] if self.bounds is None else list(self.bounds[:-1])

    @property
    def ends(self) -> set[int]:
        """Global document ends."""
        return {self.T} if self.bounds is None else set(self.bounds[1:])

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

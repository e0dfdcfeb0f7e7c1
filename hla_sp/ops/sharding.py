"""The documents and sharding of a batch as Python ints: :class:`BatchPlan`.

A :class:`BatchPlan` describes one batch (its documents and, under sequence
parallelism, every rank's length and piece) as Python ints, built once per batch
(:func:`plan_documents` on one process, ``SequenceParallel.plan_batch`` under ``sp``)
and passed as ``plan=`` to every operator and layer of the batch: they then read no
tensor on the host for its documents, and a ``torch.compile`` trace sees constants.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def bounds_digest(bounds: Sequence[int] | None) -> int:
    """A 63-bit hash of document offsets, the same in every process (0 for None)."""
    if bounds is None:
        return 0
    raw = ",".join(str(int(b)) for b in bounds).encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1


_DIGEST_MIX = 0x9E3779B97F4A7C15  # odd: (digest, G) -> digest * mix + G is one-to-one mod 2^63


def check_bounds(bounds: Sequence[int], total: int | None) -> None:
    """0 = c_0 < c_1 < ... < c_N (= ``total`` when given), or a ValueError naming
    cu_seqlens and the first offending offset."""
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens: expected cu_seqlens[0] == 0, got cu_seqlens[0] = "
                         f"{bounds[0]}")
    if total is not None and bounds[-1] != total:
        raise ValueError(f"cu_seqlens: expected cu_seqlens[-1] == T = {total}, got "
                         f"cu_seqlens[-1] = {bounds[-1]}")
    for i in range(len(bounds) - 1):
        if bounds[i] >= bounds[i + 1]:
            raise ValueError(
                f"cu_seqlens: expected strictly increasing offsets, got cu_seqlens[{i}] = "
                f"{bounds[i]} >= cu_seqlens[{i + 1}] = {bounds[i + 1]}")


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """The documents (and, under sequence parallelism, the layout) of one batch.

    Every field is a Python int (or a tuple of them): built once per batch, with at
    most one host read of ``cu_seqlens``, then shared by every layer and stage of the
    batch. ``lengths`` is empty for a plan that knows only its own shard (the
    operators build one so from a ``cu_seqlens`` tensor); ``SequenceParallel.plan_batch``
    fills it with every rank's local T, and ``pieces`` with the layout's pieces.
    """

    T_local: int  # this rank's tokens (the whole sequence on one process)
    T: int  # global sequence length
    bounds: tuple[int, ...] | None  # global document offsets [N + 1], or None
    digest: int  # bounds_digest(bounds), computed once; the agreement check carries it
    rank: int = 0
    lengths: tuple[int, ...] = ()  # every rank's local T; () when unknown
    layout: str = "contiguous"
    pieces: tuple = ()  # hla_sp.parallel.layouts.Piece, in global order; () on one process
    group: Any = None  # the process group it was planned for (None: one process)
    # The document resets per device, built once (not copied by dataclasses.replace).
    _resets: dict = dataclasses.field(default_factory=dict, init=False, repr=False,
                                      compare=False)

    def resets(self, device: torch.device) -> torch.Tensor | None:
        """[1, T_local] bool, True at every document start but the first (one process:
        what the chunk scan cuts its carry at), or None without documents; built once
        per device and kept, so every layer and stage of the batch reuses it (not kept
        while torch.compile traces: the trace makes its own)."""
        if self.bounds is None:
            return None
        if self.T_local != self.T:
            raise ValueError("plan: the resets of a sharded batch are per piece (the "
                             "sequence-parallel primitive cuts them), not of the plan")
        cached = None if torch.compiler.is_compiling() else self._resets.get(device)
        if cached is not None:
            return cached
        resets = torch.zeros(1, self.T_local, dtype=torch.bool, device=device)
        resets[0, list(self.bounds[1:-1])] = True
        if not torch.compiler.is_compiling():
            self._resets[device] = resets
        return resets

    @property
    def n_docs(self) -> int | None:
        """Number of documents N, or None without offsets."""
        return None if self.bounds is None else len(self.bounds) - 1

    def check_shard(self, q: torch.Tensor) -> None:
        """q [B, T_local, ...] must be the shard this plan was built for."""
        if q.shape[1] != self.T_local:
            raise ValueError(f"plan: expected inputs of local length T = {q.shape[1]}, got "
                             f"a plan built for T_local = {self.T_local}")
        if self.bounds is not None and q.shape[0] != 1:
            raise ValueError(f"q: expected batch size B == 1 when the plan has documents "
                             f"(packed layout), got B = {q.shape[0]}")

    def __mul__(self, G: int) -> BatchPlan:
        """The plan of the sequence with every token repeated ``G`` times (the GQA
        operators' interleaved sub-tokens), as ``cu_seqlens * G`` is for a tensor."""
        if isinstance(G, bool) or not isinstance(G, int) or G < 1:
            return NotImplemented
        if G == 1:
            return self
        bounds = None if self.bounds is None else tuple(b * G for b in self.bounds)
        pieces = tuple(dataclasses.replace(p, start=p.start * G, length=p.length * G,
                                           local_offset=p.local_offset * G)
                       for p in self.pieces)
        return dataclasses.replace(
            self, T_local=self.T_local * G, T=self.T * G, bounds=bounds,
            # Integer arithmetic, not a rehash: a torch.compile trace folds it.
            digest=(self.digest * _DIGEST_MIX + G) % (1 << 63),
            lengths=tuple(n * G for n in self.lengths), pieces=pieces)


def plan_documents(cu_seqlens: torch.Tensor | Sequence[int] | None, T: int) -> BatchPlan:
    """The one-process :class:`BatchPlan` of a batch of global length ``T``.

    Args:
        cu_seqlens: document offsets [N + 1] (0 = c_0 < ... < c_N = T), a tensor (read
            on the host once, here) or Python ints; None for one sequence per row.
        T: the sequence length.
    """
    if isinstance(T, bool) or not isinstance(T, int) or T < 0:
        raise ValueError(f"T: expected an int >= 0, got {T!r}")
    bounds = documents_bounds(cu_seqlens)
    if bounds is not None:
        check_bounds(bounds, T)
    return BatchPlan(T_local=T, T=T, bounds=bounds, digest=bounds_digest(bounds),
                     lengths=(T,))


def documents_bounds(cu_seqlens: object) -> tuple[int, ...] | None:
    """Offsets as Python ints (one host read of a tensor), shape and dtype checked."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens: expected dtype int32 or int64, got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens: expected a 1-D tensor of N + 1 >= 2 offsets, "
                             f"got {tuple(cu_seqlens.shape)}")
        bounds = tuple(cu_seqlens.tolist())  # the one host read
    elif isinstance(cu_seqlens, (list, tuple)) and all(
            isinstance(c, int) and not isinstance(c, bool) for c in cu_seqlens):
        bounds = tuple(cu_seqlens)
    else:
        raise TypeError(f"cu_seqlens: expected a 1-D integer torch.Tensor or a sequence of "
                        f"ints, got {type(cu_seqlens).__name__}")
    if len(bounds) < 2:
        raise ValueError(f"cu_seqlens: expected a 1-D tensor of N + 1 >= 2 offsets, got "
                         f"({len(bounds)},)")
    return bounds

"""Digests that are the same in every process: of host facts (:func:`hash63`,
:func:`facts_hash`) and of tensor values on their device (:func:`tensor_digest`, no
host read), and the log_decay's kind (:func:`decay_kind`). The agreement check
(:mod:`hla_sp.parallel.agreement`), the call signature (:mod:`.signature`) and the
batch plan (:mod:`.batch`) compare ranks through them."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

# log_decay kinds (row field "log_decay"); the last matches either given kind.
DECAY_KINDS = ("None", "per token", "per-head constant", "given (shard of < 2 tokens)")
UNKNOWN_KIND = 3


def hash63(data: bytes) -> int:
    """A hash that is the same in every process (Python's hash() of str is salted)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


_FNV_OFFSET, _FNV_PRIME, _U64 = 0xCBF29CE484222325, 0x100000001B3, (1 << 64) - 1


def facts_hash(facts: object) -> int:
    """A 63-bit hash of ``repr(facts)``, the same in every process: :func:`hash63` in
    eager mode (C, about 9x faster: it is on every call's path), and FNV-1a in plain
    Python under torch.compile, where the facts are the graph's constants and dynamo
    folds it at trace time (blake2b does not trace). Ranks that differ in that mode
    differ in their signatures too, and raise rather than hang."""
    if not torch.compiler.is_compiling():
        return hash63(repr(facts).encode())
    h = _FNV_OFFSET
    for ch in repr(facts):
        h = ((h ^ ord(ch)) * _FNV_PRIME) & _U64
    return h >> 1


_MIX1, _MIX2, _MIX3 = 0x2545F4914F6CDD1D, 0x9E3779B97F4A7C1 * 2 + 1, 0x5851F42D4C957F2D


def tensor_digest(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """An int64 digest of the values (as fp64) and shapes of ``tensors``, computed on
    their device (no host synchronization): equal values give equal digests on every
    rank; changing any one element always changes it (an odd weight per position)."""
    dev = next(t.device for t in tensors if t is not None)
    acc = torch.zeros((), dtype=torch.int64, device=dev)
    for i, t in enumerate(tensors):
        acc = acc * _MIX3 + facts_hash((i, None if t is None else tuple(t.shape)))
        if t is None or t.numel() == 0:
            continue
        # + 0.0 makes -0.0 into +0.0: equal values, equal bits.
        bits = (t.detach().to(device=dev, dtype=torch.float64) + 0.0).contiguous()
        bits = bits.view(torch.int64).flatten()
        weight = torch.arange(bits.numel(), device=dev, dtype=torch.int64) * (2 * _MIX1) + _MIX2
        h = bits * weight
        h = (h ^ _shr(h, 29)) * _MIX1
        acc = acc + h.sum()
    # A final mix so that every bit of the digest depends on every bit of the sum.
    acc = (acc ^ _shr(acc, 31)) * _MIX3
    return acc ^ _shr(acc, 29)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def decay_kind(g: torch.Tensor | None) -> tuple[int, torch.Tensor | None]:
    """(kind index in ``DECAY_KINDS``, the values of a per-head constant [B, H] or
    None). A log_decay broadcast over tokens (an [H] or [B, 1, H] tensor broadcast to
    [B, T, H], stride 0 over T) is a per-head constant, replicated on every rank, so
    its values must agree; a per-token log_decay is sharded like q. A shard of fewer
    than 2 tokens cannot tell the two apart (a size-1 dimension's stride means
    nothing): it only says that a log_decay is given."""
    if g is None:
        return 0, None
    if g.shape[1] < 2:
        return UNKNOWN_KIND, None
    if g.stride(1) == 0:
        # every token holds the same values: token 0's view is the constant. A plain index,
        # not as_strided with the storage offset, which dynamo cannot trace.
        return 2, g.detach()[:, 0]
    return 1, None

"""The signature of a sequence-parallel call, and the plan that carries it.

The agreement design (when the full check runs, why the signature rides in the first
all-gather of a call) is in :mod:`hla_sp.parallel.engine`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hla_sp.ops.validate import Inputs
from hla_sp.parallel.agreement import is_plain, option_tensors
from hla_sp.parallel.digests import decay_kind, facts_hash, tensor_digest
from hla_sp.parallel.plan import Plan
from hla_sp.parallel.summaries import SIGNATURE_MISMATCH


@dataclass(frozen=True)
class SignedPlan(Plan):
    """A :class:`Plan` with the call's signature and the full check to run when the
    signatures differ (on every rank: they all saw the same words)."""

    signature: torch.Tensor | None = None  # int64 0-d, on q's device; None: not signed
    recheck: Callable[[], None] | None = None

    def for_backward(self) -> Plan:
        return dataclasses.replace(self, chain=None, recheck=None)


def recheck_mismatch(plan: Plan, e: RuntimeError) -> None:
    """After a signature mismatch (every rank raised it at the same collective), run
    the full check on every rank for the ValueError that says what differs."""
    recheck = getattr(plan, "recheck", None)
    if SIGNATURE_MISMATCH in str(e) and recheck is not None:
        recheck()  # raises the detailed ValueError


def decay_ok(g: torch.Tensor | None) -> torch.Tensor:
    """1 when every log_decay value is <= 0 (NaN is not), else 0: int64 0-d, on g's
    device, computed there (no host read)."""
    if g is None or g.numel() == 0:
        return torch.ones((), dtype=torch.int64)
    return (g.detach().max() <= 0).to(torch.int64)


_SIG_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # an odd int64 multiplier


def call_signature(
    inputs: Inputs, op: str, named: list[tuple[str, object]],
    bounds_digest: int, lengths: tuple[int, ...], layout: str, method: str,
) -> torch.Tensor:
    """The call's 63-bit signature, int64 0-d on q's device, with no host read: the
    facts known on the host hashed into a Python int, then the device digests of the
    tensor values (a per-head log_decay, tensor options) and the log_decay sign bit
    mixed in on the device. It covers what the full check compares, plus the agreed
    lengths (every rank must use the same). The document offsets enter as the digest
    their plan computed once (``BatchPlan.digest``; 0 without offsets)."""
    kind, constant = decay_kind(inputs.g)
    if min(lengths) < 2:
        # A shard of fewer than 2 tokens cannot tell a per-head constant from a per-token
        # log_decay (digests.decay_kind), so no rank hashes more than "given".
        kind, constant = int(inputs.g is not None), None
    host: list[object] = [
        op, inputs.B, inputs.H, inputs.K, inputs.V, str(inputs.q.dtype), layout,
        method, inputs.scale, kind, bounds_digest, torch.is_grad_enabled(), lengths,
    ]
    tensors: list[torch.Tensor | None] = [constant]
    for name, value in named:
        # The value itself (its repr is hashed), or its tensors' shapes and dtypes (their
        # values enter by the digest below). Plain Python, so that dynamo folds it.
        ts = option_tensors(value)
        host.append((name, value if is_plain(value) else None if ts is None else
                     tuple(None if t is None else (tuple(t.shape), str(t.dtype)) for t in ts)))
        tensors.extend(ts or [])
    dev = inputs.q.device
    sig = torch.full((), facts_hash(host), dtype=torch.int64, device=dev)
    if any(t is not None and t.numel() for t in tensors):
        sig = sig * _SIG_MIX + tensor_digest([t for t in tensors]).to(dev)
    sig = sig * 2 + (1 if inputs.g is None else decay_ok(inputs.g))
    return sig & ((1 << 63) - 1)

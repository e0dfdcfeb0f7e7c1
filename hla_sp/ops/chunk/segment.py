"""Whole segments in one piece: a segment's summary state, the term a carried-in state
adds to its outputs, and the document starts of packed sequences.

Used where a segment's state or carry is needed apart from the chunk path (the
composed sequence-parallel pieces, the variable-length calls); same algebra, one
weighted K^T V or q^T h0 per segment.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from hla_sp.ops.dispatch import compute_dtype
from hla_sp.ops.isolation import bad_state, bad_tokens, cuts, finite, finite_decay, poisoned_prefix

Tensor = torch.Tensor


def document_resets(bounds: Sequence[int], T: int, device: torch.device) -> torch.Tensor:
    """[1, T] bool ``resets``: True at every document start but the first.

    Args:
        bounds: the document offsets as Python ints, [N + 1] (cu_seqlens.tolist()).
    """
    resets = torch.zeros(1, T, dtype=torch.bool, device=device)
    resets[0, list(bounds[1:-1])] = True
    return resets


def segment_summary(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summary of a whole segment from a zero state: one weighted K^T V.

    Args:
        k: [B, L, H, K], v: [B, L, H, V], g: [B, L, H] or None.

    Returns:
        h: [B, H, K, V] = sum_j exp(A_L - A_j) k_j v_j^T (compute dtype), and
        a: [B, H], the segment's total log-decay A_L.
    """
    cdt = compute_dtype(k.dtype)
    B, _L, H, _ = k.shape
    # clean operands, the poison put back by a flag (hla_sp.ops.isolation): a token cut
    # off by a later hard reset has weight 0, and 0 * NaN would still be NaN
    reach = poisoned_prefix(bad_tokens(k, v, g), cuts(None, g, k))[:, -1] if _L else None
    k, v = finite(k.to(cdt)), finite(v.to(cdt))
    if g is None:
        h = torch.einsum("blhk,blhv->bhkv", k, v)
        total = torch.zeros(B, H, dtype=cdt, device=k.device)
    else:
        # exp(A_L - A_j) as the exp of a suffix sum: A_L - A_j cancels catastrophically
        # in fp32 once |A_L| is large (a long shard: |A_L| ~ 1e4 costs ~1e-3 relative).
        suffix = finite_decay(g.to(cdt)).flip(1).cumsum(1).flip(1)  # sum_{i >= j} g_i
        total = suffix[:, 0]
        w = torch.exp(F.pad(suffix[:, 1:], (0, 0, 0, 1)))  # sum_{i > j} g_i
        h = torch.einsum("blhk,blhv->bhkv", k * w[..., None], v)
    if reach is not None:
        h = torch.where(reach[..., None, None], float("nan"), h)
    return h, total


def with_carry_terms(
    o: Tensor, q: Tensor, g: Tensor | None, spans: Sequence[tuple[int, int, Tensor]]
) -> Tensor:
    """o [B, T, H G, V] with, on each span [s, e) (disjoint, in order), the term of the
    state h [B, H, K, V] carried into it: :func:`carry_term` of that span. A new tensor
    (no in-place write on o, which autograd may hold)."""
    if not spans:
        return o
    parts, at = [], 0
    for s, e, h in spans:
        term = carry_term(q[:, s:e], None if g is None else g[:, s:e], h)
        parts += [o[:, at:s], o[:, s:e] + term]
        at = e
    parts.append(o[:, at:])
    return torch.cat(parts, dim=1)


def carry_term(q: torch.Tensor, g: torch.Tensor | None, h0: torch.Tensor) -> torch.Tensor:
    """What a carry-in state adds to a segment's outputs: exp(A_t) q_t^T h0.

    Args:
        q: [B, L, H G, K] (scaled; G query heads per kv head, multi-query),
        g: [B, L, H] or None, h0: [B, H, K, V].

    Returns:
        [B, L, H G, V] in the compute dtype.
    """
    cdt = compute_dtype(q.dtype)
    B, L, Hq, K = q.shape
    H = h0.shape[1]
    # clean operands (a q_t after a hard reset must not bring a NaN into h0's gradient),
    # and a non-finite h0's poison put back on the tokens it reaches
    qg = finite(q.to(cdt)).reshape(B, L, H, Hq // H, K)
    out = torch.einsum("blhgk,bhkv->blhgv", qg, finite(h0.to(cdt)))
    reach = bad_state(h0)[:, None]  # [B, 1, H]
    if g is not None:
        A = finite_decay(g.to(cdt)).cumsum(1)
        out = out * torch.exp(A)[..., None, None]
        reach = reach & ~torch.isneginf(A)  # up to the first hard reset
    out = torch.where(reach[..., None, None], float("nan"), out)
    return out.reshape(B, L, Hq, -1)

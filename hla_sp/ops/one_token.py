"""One token of the primitive, for decoding: the recurrence's step itself.

A decode step feeds one token per sequence with the state so far. The chunk scan would
pad it to a whole chunk, cut it into blocks and put the isolation flags back
(:mod:`hla_sp.ops.isolation`); here it is the recurrence directly,

    h_1 = exp(g_1) h_0 + k_1 v_1^T,    o_1 = q_1^T h_1,

in the compute dtype. Plain arithmetic gives the isolation's rules at one token, but
for one: a non-finite k, v or decay makes o_1 non-finite and h_1 too (a zero h_0
stands in for a missing one, so exp(NaN) * 0 is NaN too), a non-finite q only o_1,
and a hard reset (g = -inf) cuts h_0, even a non-finite one, by a select rather than
exp(-inf) * h_0. The one: arithmetic poisons only the state's rows or columns of the
bad entry, the scan the head's whole state; the step does as the scan.
Used without autograd only: the chunk path's backward keeps segment-wide poisoning.
"""

from __future__ import annotations

import torch

from hla_sp.ops.dispatch import compute_dtype
from hla_sp.ops.isolation import bad_state, poison_

Tensor = torch.Tensor


def needs_grad(*xs: Tensor | None) -> bool:
    """Whether autograd would record a call on ``xs``."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


def one_token(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, h0: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The primitive over one token per sequence.

    Args:
        q: [B, 1, H G, K] (scaled; G query heads per kv head), k: [B, 1, H, K],
            v: [B, 1, H, V],
        g: [B, 1, H] log-decay or None, h0: [B, H, K, V] or None.

    Returns:
        o [B, 1, H G, V] and h_1 [B, H, K, V], in the compute dtype, new tensors.
    """
    cdt = compute_dtype(q.dtype)
    k1, v1 = k[:, 0].to(cdt), v[:, 0].to(cdt)
    h = k1[..., :, None] * v1[..., None, :]
    if g is not None or h0 is not None:
        carried = torch.zeros_like(h) if h0 is None else h0.to(cdt)
        if g is not None:
            g1 = g[:, 0].to(cdt)[..., None, None]
            carried = torch.where(g1 == float("-inf"), 0.0, torch.exp(g1) * carried)
        h = h + carried
    # a non-finite entry poisons the head's whole state, as the scan's flags do
    poison_(h, bad_state(h))
    B, _, Hq, K = q.shape
    # multi-query: query head h G + j reads the state of kv head h
    qg = q[:, 0].to(cdt).reshape(B, h.shape[1], Hq // h.shape[1], K)
    o = torch.einsum("bhgk,bhkv->bhgv", qg, h).reshape(B, 1, Hq, -1)
    return o.contiguous(), h

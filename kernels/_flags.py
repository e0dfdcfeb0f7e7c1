"""Flags of non-finite inputs, raised by the kernels from the loads they make anyway.

A call's flags are one int32 tensor [B, T + 2, H] (H kv heads), zeroed by its launcher:

    fl[b, t, h]      1 when token t's row of the flagged operands holds a NaN or ±inf
                     (forward: k, v, the log-decay's NaN or +inf; backward: q and the
                     output cotangent of any query head of the group)
    fl[b, T, h]      1 when the state entering (forward: h0) or leaving (backward: dh_T)
                     the sequence holds one
    fl[b, T + 1, h]  1 when anything of (b, h) above is set: the gate of the poison
                     kernels (:mod:`hla_sp.kernels.poison_kernels`), which return at once
                     on a 0, so that finite inputs pay one word read per (b, h)

The state-pass programs of one (b, h) see the rows block by block ([BT, BK] of k,
[BT, BV] of v); each flags what it sees, and the union over the blocks is the row.
Writers only ever store 1, so concurrent stores of one flag agree; the gate word takes
an atomic max, issued only by a chunk that found something.
"""

from __future__ import annotations

import triton.language as tl

from ._jit import jit_helper


@jit_helper
def rows_bad(x):
    """[BT, BD] -> [BT] int1: the rows of ``x`` (as loaded, before cleaning) holding a
    NaN or an infinity."""
    return tl.max(tl.where(tl.abs(x) < float("inf"), 0, 1), 1) > 0


@jit_helper
def raise_tokens(fl, i_b, i_h, o_t, m_t, T, H, bad):
    """Set fl[b, t, h] for the tokens ``o_t`` [BT] (``m_t`` in range) where ``bad``, and
    the gate word of (b, h) when any is."""
    base = fl + i_b * (T + 2) * H + i_h
    tl.store(base + o_t * H, tl.full(o_t.shape, 1, tl.int32), mask=m_t & bad)
    n = tl.sum(tl.where(m_t & bad, 1, 0), 0)
    tl.atomic_max(base + (T + 1) * H, 1, mask=n > 0)


@jit_helper
def raise_state(fl, i_b, i_h, T, H, x):
    """Set fl[b, T, h] and the gate word of (b, h) when the state block ``x`` (as loaded)
    holds a NaN or an infinity."""
    base = fl + i_b * (T + 2) * H + i_h
    n = tl.sum(tl.sum(tl.where(tl.abs(x) < float("inf"), 0, 1), 1), 0)
    tl.atomic_max(base + T * H, 1, mask=n > 0)
    tl.atomic_max(base + (T + 1) * H, 1, mask=n > 0)

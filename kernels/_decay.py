"""The in-chunk decay of every kernel, written once, from stable segment sums.

For one chunk of BT tokens with log-decays g (0 on padding) and c the number of
document starts (``resets``) seen so far in the chunk:

    D[t, j] = exp(seg[t, j]) [j <= t] [c_t == c_j]   pair weight,  seg[t, j] = sum_{j<s<=t} g_s
    ws_j    = exp(seg[C, j]) [c_j == c_C]            weight of token j in the chunk's state
    wc_t    = exp(sum_{s<=t} g_s) [c_t == 0]         weight of the incoming state
    p       = exp(sum_s g_s) [c_C == 0]              pass factor of the chunk

The exponents are never differences of prefix sums: ``b_t - b_j`` with a large
negative g between (or before) j and t cancels catastrophically (at g = -1e4 the
exponent is off by ~1e4 * 2^-24 = 6e-4, at -1e30 it is pure noise), and with
g = -inf (a hard reset) it is -inf - (-inf) = NaN. seg is instead the masked
cumulative sum of Mamba-2's ``segsum``: column j of ``where(s > j, g_s, 0)`` summed
down the rows, so each exponent is a sum of exactly the log-decays it spans; sums of
-inf and finite values stay -inf, whose exp is an exact 0.

The helper is a plain ``triton.runtime.jit.JITFunction`` built at import whatever
``TRITON_INTERPRET`` says; :mod:`hla_sp.kernels._jit` swaps an interpreter build of it
into the kernel modules for interpreted launches, as it does for Triton's stdlib.
"""

from __future__ import annotations

import triton.language as tl

from ._jit import jit_helper


@jit_helper
def in_chunk_decay(
    g,  # [B, T, H] fp32 log-decay (HAS_G)
    r,  # [B, T] int32 document starts (HAS_R)
    i_b,  # int64 batch index
    i_h,  # head index
    o_t,  # [BT] token indices of the chunk
    T,
    H,
    BT: tl.constexpr,
    HAS_G: tl.constexpr,
    HAS_R: tl.constexpr,
):
    """Returns (wc [BT], ws [BT], p scalar, D [BT, BT]), all fp32, as in the module doc.

    Unused results cost nothing: the compiler drops what a kernel does not read.
    """
    o_i = tl.arange(0, BT)
    m_t = o_t < T
    m_D = o_i[:, None] >= o_i[None, :]
    if HAS_G:
        b_g = tl.load(g + (i_b * T + o_t) * H + i_h, mask=m_t, other=0.0)
        # NaN and +inf (poisoned, flagged by the caller) decay nothing; -inf is a cut
        b_g = tl.where(b_g < float("inf"), b_g, 0.0)
        # seg[t, j] = sum_{j < s <= t} g_s: a cumsum down the rows of g_s [s > j]
        b_seg = tl.cumsum(tl.where(o_i[:, None] > o_i[None, :], b_g[:, None], 0.0), 0)
        b_wc = tl.exp(tl.cumsum(b_g, 0))
        # sum_{s > j} g_s (seg's last row), the decay from token j to the chunk's end, as
        # a masked sum: a kernel that reads no D (the state passes) runs no [BT, BT] cumsum
        b_ws = tl.exp(tl.sum(tl.where(o_i[:, None] > o_i[None, :], b_g[:, None], 0.0), 0))
        b_p = tl.exp(tl.sum(b_g, 0))
    else:
        b_seg = tl.zeros([BT, BT], dtype=tl.float32)
        b_wc = tl.full([BT], 1.0, dtype=tl.float32)
        b_ws = tl.full([BT], 1.0, dtype=tl.float32)
        b_p = tl.sum(b_wc, 0) * 0.0 + 1.0
    if HAS_R:
        b_c = tl.cumsum(tl.load(r + i_b * T + o_t, mask=m_t, other=0), 0)
        b_cC = tl.sum(tl.where(o_i == BT - 1, b_c, 0), 0)
        b_wc = tl.where(b_c == 0, b_wc, 0.0)
        b_ws = tl.where(b_c == b_cC, b_ws, 0.0)
        b_p = tl.where(b_cC == 0, b_p, 0.0)
        m_D = m_D & (b_c[:, None] == b_c[None, :])
    # exp only of masked-in exponents (sums of non-positive log-decays)
    b_D = tl.exp(tl.where(m_D, b_seg, float("-inf")))
    return b_wc, b_ws, b_p, b_D

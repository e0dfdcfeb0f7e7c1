"""Rounding to the inputs' 16-bit dtype, written once for every kernel.

A GPU converts fp32 to bf16 by rounding to nearest even (``cvt.rn.bf16.f32``). Triton's
CPU interpreter truncates instead, which biases every rounding the same way: errors
then add up linearly rather than cancelling, and interpreted bf16 runs were 2-4x less
accurate than the same kernels on a GPU. With ``EMULATE`` (the kernels' ``UPCAST``,
set only under the interpreter) the rounding is done on the bits first, so that the
truncation that follows is exact and the interpreter has the GPU's numerics. fp16 is
converted correctly by the interpreter, and on a GPU ``EMULATE`` is False: both are
plain casts.
"""

from __future__ import annotations

import triton.language as tl

from ._jit import jit_helper


@jit_helper
def round_to(x, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (to nearest even, also under the interpreter)."""
    if EMULATE and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        # + half an ulp of bf16, minus one when the kept last bit is even (ties to even)
        bits += 0x7FFF + ((bits >> 16) & 1)
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@jit_helper
def operand(x, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """An fp32 intermediate as a dot operand: rounded to the inputs' ``dtype`` (tensor
    cores read 16-bit operands), and widened back to fp32 under the interpreter, whose
    16-bit arithmetic is not exact. An ``x`` loaded in ``dtype`` already (a chunk state
    stored at the inputs' dtype) is not rounded again."""
    if x.dtype == dtype:
        y = x
    else:
        y = round_to(x, dtype, EMULATE)
    if EMULATE:
        y = y.to(tl.float32)
    return y


@jit_helper
def finite(x):
    """``x`` with every NaN and ±inf set to 0: an operand the kernels can sum safely.

    A zero weight must mean nothing, but a dot gives 0 * NaN = NaN: one non-finite
    value would reach every row it is summed into, across document starts and the
    causal mask. The kernels compute on clean operands; the autograd glue in
    :mod:`hla_sp.ops` puts the poison back by flags (``hla_sp.ops.isolation``)."""
    return tl.where(tl.abs(x) < float("inf"), x, 0.0)

"""The precision flags of a launch: the dot precision and the interpreter's bf16 emulation.

Read by every launcher (:mod:`hla_sp.kernels.chunk`, :mod:`hla_sp.kernels.hla2_fused`).
"""

from __future__ import annotations

import torch

from ._jit import interpreting


def dot_precision(dtype: torch.dtype) -> str:
    """The ``DOT_PREC`` of a launch for inputs of ``dtype``: IEEE fp32 dots ("ieee")
    unless torch itself is allowed TF32 for fp32 matmuls ("tf32")."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def upcast_bf16(dtype: torch.dtype) -> bool:
    """The ``UPCAST`` flag of a launch for inputs of ``dtype``: True for bf16 under the
    interpreter, which then computes in fp32 with the roundings emulated.

    Triton's CPU interpreter holds bf16 as raw 16-bit integers: conversions are right,
    arithmetic and dots on them are not. The kernels then widen every bf16 load to
    fp32 and round each dot operand through bf16 and back, so the interpreter runs the
    same roundings as a GPU (to nearest even: ``kernels/_round.py``).
    """
    return dtype == torch.bfloat16 and interpreting()

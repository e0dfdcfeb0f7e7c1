"""Triton kernels of hla-sp (imported as ``hla_sp.kernels``).

Importing this package needs triton but touches no GPU driver: kernels are jitted on
their first launch (see :mod:`hla_sp.kernels._jit`).
"""

from ._jit import LAUNCHES, interpreting
from .chunk import (
    ChunkLinearAttentionFunction,
    chunk_bwd,
    chunk_fwd,
    chunk_linear_attention_triton,
)
from .hla2_fused import FusedHLA2Function, fused_hla2_chunk, hla2_fused

__all__ = [
    "LAUNCHES",
    "ChunkLinearAttentionFunction",
    "FusedHLA2Function",
    "chunk_bwd",
    "chunk_fwd",
    "chunk_linear_attention_triton",
    "fused_hla2_chunk",
    "hla2_fused",
    "interpreting",
]

"""Triton kernels of hla-sp (imported as ``hla_sp.kernels``).

- :mod:`~hla_sp.kernels.chunk`: the primitive (decayed causal linear attention) as
  chunk_state -> state_passing -> chunk output kernels, the backward kernels,
  :class:`ChunkLinearAttentionFunction` and :func:`chunk_linear_attention_triton`,
  which :mod:`hla_sp.ops.dispatch` selects for CUDA tensors.
- :mod:`~hla_sp.kernels.hla2_fused`: second-order HLA with k~ = S q kept on chip,
  opt-in through :func:`hla2_fused` until a GPU benchmark decides
  (benchmarks/gpu_check.sh).
- :mod:`~hla_sp.kernels._jit`: kernels are jitted on first launch, so importing this
  package touches no GPU driver, and :data:`LAUNCHES` counts launches per kernel.

On CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``), which is
how the tests exercise them.
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

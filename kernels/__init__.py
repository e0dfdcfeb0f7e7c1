"""Triton kernels of hla-sp (imported as ``hla_sp.kernels``).

Only kernels and their launchers live here: no autograd, and nothing imported from the
rest of ``hla_sp``. :mod:`hla_sp.ops.dispatch` is the one module that imports this
package; the autograd glue (one ``torch.library`` custom operator for the primitive,
the fused hla2's ``autograd.Function``) is in :mod:`hla_sp.ops`.

- :mod:`~hla_sp.kernels.chunk`: the primitive (decayed causal linear attention) as
  one state-pass kernel per direction (fla's chunk_h) -> chunk output kernels and the
  backward kernels;
  :func:`chunk_forward` / :func:`chunk_backward` take unprepared tensors, and
  isolate documents from non-finite inputs given flags (:func:`new_flags`, one
  gated poison launch per direction: :mod:`~hla_sp.kernels.poison`).
- :mod:`~hla_sp.kernels.hla2_fused`: second-order HLA with k~ = S q kept on chip,
  :func:`fused_hla2_forward` / :func:`fused_hla2_backward`.
- :mod:`~hla_sp.kernels._jit`: kernels are jitted on first launch, so importing this
  package touches no GPU driver, and :data:`LAUNCHES` counts launches per kernel.

On CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``), which is
how the tests exercise them.
"""

from ._jit import LAUNCHES, interpreter_mismatch, interpreting
from .chunk import chunk_backward, chunk_bwd, chunk_forward, chunk_fwd
from .hla2_fused import MODES, fused_hla2_backward, fused_hla2_forward, sequential_refusal
from .poison import new_flags

__all__ = [
    "LAUNCHES",
    "MODES",
    "chunk_backward",
    "chunk_bwd",
    "chunk_forward",
    "chunk_fwd",
    "fused_hla2_backward",
    "fused_hla2_forward",
    "interpreter_mismatch",
    "interpreting",
    "new_flags",
    "sequential_refusal",
]

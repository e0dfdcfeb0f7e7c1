"""The chunk-parallel PyTorch path of the primitive, decayed causal linear attention.

Inside a chunk of C tokens the work is masked matmuls; between chunks a state of
size K x V is passed on. This is the algebra of the segment summaries (docs/math.md
section 4) with chunks in place of ranks:

    summary of chunk n:   s_n = sum_j exp(b_C - b_j) k_j v_j^T,  pass factor p_n = exp(b_C)
    state after chunk n:  h_n = p_n h_{n-1} + s_n
    output:               o_t = sum_{j<=t in chunk} exp(b_t - b_j)(q_t.k_j) v_j
                              + exp(b_t) q_t h_{n-1}

with b the within-chunk cumulative log-decay. Every in-chunk weight is the exp of a
*segment sum* (a masked cumulative sum of the log-decays between two tokens, as
Mamba-2's ``segsum``), never a difference of two prefix sums: b_t - b_j cancels
catastrophically once one token's decay is huge (-1e6 costs all of fp32's digits,
-1e30 all of fp64's) and is NaN for a hard reset (-inf - -inf). A segment sum has
no cancellation, and -inf simply gives a weight of 0.

Memory: the forward keeps nothing but its inputs (the custom operator of
:mod:`hla_sp.ops.primitive` saves q, k, v, g, h0); the backward recomputes the chunk
summaries (one batched matmul), the state scan and the intra-chunk terms, and applies
hand-written gradients. All chunks are handled by batched matmuls over
[B, H, N, C, .]; only the state passing between chunks is a loop over N, on
[B, H, K, V] states, in place. Cost O(T C (K + V) + T K V) time and O(T (C + K + V))
transient memory.

Document starts (``resets``) cut the carry, which is the summary's "contains a
start" flag: pairs across a start are masked, and a chunk containing a start passes
on only the part after its last start.

Modules: :mod:`~hla_sp.ops.chunk.layout` (cutting into chunks and blocks, the decay
weights), :mod:`~hla_sp.ops.chunk.algebra` (one block's state scan and gradient
terms, shared with :mod:`hla_sp.ops.chunk_split`), :mod:`~hla_sp.ops.chunk.scan`
(the blocked forward and backward), :mod:`~hla_sp.ops.chunk.segment` (whole-segment
summaries and carry terms).
"""

from hla_sp.ops.chunk.layout import segsum
from hla_sp.ops.chunk.scan import chunk_backward, chunk_forward
from hla_sp.ops.chunk.segment import (
    carry_term,
    document_resets,
    segment_summary,
    with_carry_terms,
)

__all__ = [
    "carry_term",
    "chunk_backward",
    "chunk_forward",
    "document_resets",
    "segment_summary",
    "segsum",
    "with_carry_terms",
]

"""The HLA attention layer: projections, GQA, decay, the first-order path, norms, decoding.

* :class:`HLAHeads` (:mod:`hla_sp.nn.heads`) works on per-head q, k, v: everything a
  plain PyTorch layer and Megatron's core-attention slot have in common.
* :class:`HLAttention` (:mod:`hla_sp.nn.layer`) adds the q/k/v/o projections and decoding.

The operators themselves, GQA included (:func:`hla_sp.ops.runner.run_operator`),
live in :mod:`hla_sp.ops`; this package holds only modules.
"""

from hla_sp.config import DECAYS, OPERATORS
from hla_sp.nn.heads import HLAHeads, retnet_log_decay
from hla_sp.nn.layer import HLAttention

__all__ = ["DECAYS", "OPERATORS", "HLAHeads", "HLAttention", "retnet_log_decay"]

"""The HLA attention layer: projections, GQA, decay, the first-order path, norms, decoding.

* :class:`HLAHeads` (:mod:`hla_sp.nn.heads`) works on per-head q, k, v: everything a
  plain PyTorch layer and Megatron's core-attention slot have in common.
* :class:`HLAttention` (:mod:`hla_sp.nn.layer`) adds the q/k/v/o projections and decoding.
* :func:`grouped_operator` (:mod:`hla_sp.nn.grouped`) runs an operator with grouped keys
  and values (GQA/MQA), the key moment shared per group, exact through the primitive.
"""

from hla_sp.config import DECAYS, OPERATORS
from hla_sp.nn.grouped import LinearState, grouped_operator
from hla_sp.nn.heads import HLAHeads, retnet_log_decay
from hla_sp.nn.layer import HLAttention

__all__ = ["DECAYS", "OPERATORS", "HLAHeads", "HLAttention", "LinearState", "grouped_operator",
           "retnet_log_decay"]

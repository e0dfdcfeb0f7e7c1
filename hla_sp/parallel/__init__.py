"""Exact sequence parallelism: segment summaries, their exchange, layouts.

``SequenceParallel`` is passed as ``sp=`` to every operator; each rank passes its
local shard and gets its slice of the single-process result.
"""

from hla_sp.parallel.comm import reset_traffic, traffic
from hla_sp.parallel.engine import METHODS, SequenceParallel
from hla_sp.parallel.layouts import LAYOUTS, positions, shard, split_lengths
from hla_sp.parallel.plan import Plan

__all__ = [
    "LAYOUTS",
    "METHODS",
    "Plan",
    "SequenceParallel",
    "positions",
    "reset_traffic",
    "shard",
    "split_lengths",
    "traffic",
]

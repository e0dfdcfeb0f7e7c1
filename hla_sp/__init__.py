"""hla-sp: Higher-order Linear Attention with exact sequence parallelism.

The operators (``hla_sp.hla2``, ``hla_sp.ahla``, ``hla_sp.hla3``, ``hla_sp.ccq``,
``hla_sp.linear_attention``, every built-in of the operator table) and their state
types are exported here from :mod:`hla_sp.ops`.
"""

from hla_sp import ops as _ops

__version__ = "0.1.0"

globals().update(_ops.BUILTINS)

__all__ = sorted([*_ops.BUILTINS, "SequenceParallel"])


def __getattr__(name: str):
    # Imported lazily so that `import hla_sp` needs no torch.distributed setup.
    if name == "SequenceParallel":
        from hla_sp.parallel import SequenceParallel

        return SequenceParallel
    raise AttributeError(f"module 'hla_sp' has no attribute {name!r}")

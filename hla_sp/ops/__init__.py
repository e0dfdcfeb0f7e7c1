"""Operators: the primitive, the table of its compositions, their runner, the references.

Every built-in operator's public function and state type is exported from here (and
from ``hla_sp``) by its entry in the table, so a new built-in needs no export line.
"""

from hla_sp.config import BUILTIN_OPERATORS
from hla_sp.ops import operators, vmap_rules  # noqa: F401  (registers the vmap rules)
from hla_sp.ops.fused import hla2_fused as hla2_fused
from hla_sp.ops.runner import run_operator as run_operator


def _builtin_exports() -> dict[str, object]:
    """Name -> object: each built-in's public function and its state type."""
    out: dict[str, object] = {}
    for name in BUILTIN_OPERATORS:
        spec = operators.get(name)
        out[spec.public.__name__] = spec.public
        out[spec.state_type.__name__] = spec.state_type
    return out


BUILTINS = _builtin_exports()
globals().update(BUILTINS)  # hla2, ahla, hla3, ccq, linear_attention and their states

__all__ = sorted([*BUILTINS, "hla2_fused", "operators", "run_operator"])

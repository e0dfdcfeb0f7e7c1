"""hla-sp: Higher-order Linear Attention with exact sequence parallelism."""

from hla_sp.ops import (
    AHLAState,
    CCQState,
    HLA2State,
    HLA3State,
    ahla,
    ccq,
    hla2,
    hla3,
    linear_attention,
)

__version__ = "0.1.0"

__all__ = [
    "AHLAState",
    "CCQState",
    "HLA2State",
    "HLA3State",
    "SequenceParallel",
    "ahla",
    "ccq",
    "hla2",
    "hla3",
    "linear_attention",
]


def __getattr__(name: str):
    # Imported lazily so that `import hla_sp` needs no torch.distributed setup.
    if name == "SequenceParallel":
        from hla_sp.parallel import SequenceParallel

        return SequenceParallel
    raise AttributeError(f"module 'hla_sp' has no attribute {name!r}")

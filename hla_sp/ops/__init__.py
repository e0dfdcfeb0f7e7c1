"""Operators: the primitive, its compositions, their table and runner, the references."""

from hla_sp.ops.compositions import AHLAState, CCQState, HLA2State, HLA3State, LinearState
from hla_sp.ops.fused import hla2_fused
from hla_sp.ops.linear_attention import linear_attention
from hla_sp.ops.operators import ahla, ccq, hla2, hla3
from hla_sp.ops.runner import run_operator

__all__ = [
    "AHLAState",
    "CCQState",
    "HLA2State",
    "HLA3State",
    "LinearState",
    "ahla",
    "ccq",
    "hla2",
    "hla2_fused",
    "hla3",
    "linear_attention",
    "run_operator",
]

"""Operators: the primitive, its compositions and their references."""

from hla_sp.ops.compositions import AHLAState, HLA2State, HLA3State, ahla, hla2, hla3
from hla_sp.ops.linear_attention import linear_attention

__all__ = ["AHLAState", "HLA2State", "HLA3State", "ahla", "hla2", "hla3", "linear_attention"]

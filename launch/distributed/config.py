"""The parallel layout's config section, [parallelism]: CP, TP and the process group's
timeout. Their fit to the world size is checked by :mod:`hla_sp.launch.checks`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hla_sp.launch.config.sections import Range, Section

__all__ = ["ParallelismConfig"]


@dataclass
class ParallelismConfig(Section):
    """The parallel layout and the process group ([parallelism])."""

    context_parallel_size: int = 1
    """Ranks that share one sequence (HLA's exact scan runs across them)."""
    tensor_model_parallel_size: int = 1
    """Ranks that share each weight matrix (Megatron tensor parallelism)."""
    distributed_timeout_minutes: float = 10.0
    """Process-group timeout: a hung or dead peer ends every rank after this long."""

    RANGES: ClassVar[dict[str, Range]] = {
        "context_parallel_size": ("[", 1, None, "]"),
        "tensor_model_parallel_size": ("[", 1, None, "]"),
        "distributed_timeout_minutes": ("(", 0, None, "]"),
    }

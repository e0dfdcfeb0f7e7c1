"""The trainer's performance section: torch.compile of the layers and torch.profiler
traces ([performance]). What needs other sections or the world size (the profiled steps
within --train-iters, the ranks within the world, where traces go) is checked by
:func:`hla_sp.launch.train.perf_checks.check_performance`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hla_sp.launch.config.sections import Range, Section
from hla_sp.launch.errors import ConfigError

__all__ = ["PerformanceConfig"]


@dataclass
class PerformanceConfig(Section):
    """Compiling the layers and profiling steps ([performance])."""

    compile: bool = False
    """torch.compile each transformer layer with fullgraph=True (inductor), inside the
    full-recompute wrapper (selective recompute is traced into the layer's graph); a graph
    break stops the run at the first step, which pays the compilation (tens of seconds to
    minutes on CPU). Refused with tensor parallelism, which does not trace whole."""
    profile: bool = False
    """Record torch.profiler traces (CPU, plus CUDA on GPU) of the steps from
    --profile-step-start to --profile-step-end on each of --profile-ranks, one Chrome
    trace per rank, <--tensorboard-dir, else --save>/profile/rank<R>.steps<N>-<M>.pt.trace.json
    (chrome://tracing, Perfetto). Profiled steps run slower; the others pay nothing."""
    profile_step_start: int = 10
    """With --profile: the first profiled step, counted from 0 as Megatron does (step N
    is the one that logs iteration N + 1); the profiler warms up on the step before."""
    profile_step_end: int = 12
    """With --profile: the step after the last profiled one (steps start to end - 1)."""
    profile_ranks: list[int] | None = None
    """With --profile: the global ranks that record a trace (default: rank 0)."""
    profile_record_shapes: bool = False
    """With --profile: record each op's input shapes (larger traces, more overhead)."""

    RANGES: ClassVar[dict[str, Range]] = {
        "profile_step_start": ("[", 0, None, "]"),
        "profile_step_end": ("[", 1, None, "]"),
    }

    @property
    def ranks(self) -> list[int]:
        """The ranks that record a trace (--profile-ranks, default rank 0)."""
        return list(self.profile_ranks) if self.profile_ranks is not None else [0]

    def validate(self) -> None:
        """Ranges; the profiled steps in order."""
        super().validate()
        if self.profile and self.profile_step_end <= self.profile_step_start:
            raise ConfigError(
                f"--profile-step-end: expected > --profile-step-start "
                f"{self.profile_step_start}, got {self.profile_step_end}")

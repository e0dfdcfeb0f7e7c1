"""--profile: torch.profiler over the steps --profile-step-start to --profile-step-end.

Steps are counted from 0 as in Megatron (step N logs iteration N + 1). Each rank of
--profile-ranks records the CPU (and on GPU the CUDA) activity of those steps and writes
one Chrome trace, ``<--tensorboard-dir, else --save>/profile/rank<R>.steps<N>-<M>.pt.trace.json``
(never overwritten: a resumed run's trace of the same window gets ``.2``, ``.3``, ...);
each step is a ``ProfilerStep#<step>`` span in it (the step, its evaluation and its
logging), and each HLA core attention call a ``hla_sp::<operator>`` span (forward, and
its recomputation under full recompute; the backward shows as the operator's autograd
functions, ``_ScanBackward`` and the like under CP). The step before the first profiled one
is a warm-up, recorded and discarded (the profiler's start-up would skew it). The other
ranks pay nothing.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from hla_sp.launch.checks import profile_dir
from hla_sp.launch.config.train_config import TrainConfig
from hla_sp.launch.distributed.process_groups import Topology
from hla_sp.launch.train.metrics import say
from torch.profiler import ProfilerAction, ProfilerActivity

__all__ = ["StepProfiler", "label_attention", "trace_path"]


def label_attention(model: torch.nn.Module) -> int:
    """Wrap each HLA core attention's forward in a ``hla_sp::<operator>`` profiler span
    (a no-op while no profiler records; ignored inside a compiled layer's graph, where
    the layer shows as its compiled region); returns how many were labelled."""
    from hla_sp.megatron_patch.checks import hla_report

    cores, hla = dict(model.named_modules()), hla_report(model)[0]
    for where, operator in hla.items():
        core = cores[where]
        core.forward = _labelled(core.forward, f"hla_sp::{operator}")
    return len(hla)


def _labelled(fn: Any, name: str) -> Any:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)

    return run


def trace_path(cfg: TrainConfig, rank: int) -> str:
    """The Chrome trace that ``rank`` writes for this run's --profile steps."""
    perf = cfg.performance
    base = profile_dir(cfg)
    assert base is not None, "checks.validate refuses --profile without a directory"
    name = f"rank{rank}.steps{perf.profile_step_start}-{perf.profile_step_end}.pt.trace.json"
    return os.path.join(base, name)


TRACE_SUFFIX = ".pt.trace.json"


def unused_path(path: str) -> str:
    """``path``, or when a trace is there already (an earlier launch of the run, before
    a resume), the first free ``<name>.2.pt.trace.json``, ``.3``, ...: traces are never
    overwritten."""
    if not os.path.lexists(path):
        return path
    stem = path[: -len(TRACE_SUFFIX)] if path.endswith(TRACE_SUFFIX) else path
    n = 2
    while os.path.lexists(f"{stem}.{n}{TRACE_SUFFIX}"):
        n += 1
    return f"{stem}.{n}{TRACE_SUFFIX}"


class StepProfiler:
    """The profiler of one rank over the loop: :meth:`start` before the first step,
    :meth:`step` after each, :meth:`stop` at the end (a window cut short by
    --exit-interval or a signal is written as far as it went)."""

    def __init__(self, cfg: TrainConfig, topo: Topology, first_step: int,
                 model: torch.nn.Module):
        perf = cfg.performance
        self.start_step, self.end_step = perf.profile_step_start, perf.profile_step_end
        self.enabled = (perf.profile and topo.rank in perf.ranks
                        and first_step < self.end_step)
        self.path = trace_path(cfg, topo.rank) if self.enabled else ""
        self.first_step = first_step
        self._prof: Any = None
        if not self.enabled:
            return
        label_attention(model)
        activities = [ProfilerActivity.CPU]
        if topo.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(
            activities=activities, schedule=self._action, on_trace_ready=self._write,
            record_shapes=perf.profile_record_shapes)

    def _action(self, step: int) -> ProfilerAction:
        """What the profiler does during ``step`` (an absolute step, from 0)."""
        if step >= self.end_step:
            return ProfilerAction.NONE
        if step >= self.start_step:
            last = step == self.end_step - 1
            return ProfilerAction.RECORD_AND_SAVE if last else ProfilerAction.RECORD
        return ProfilerAction.WARMUP if step == self.start_step - 1 else ProfilerAction.NONE

    def _write(self, prof: torch.profiler.profile) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.path = unused_path(self.path)  # a resumed run's trace never replaces one
        prof.export_chrome_trace(self.path)
        say(f"profile: steps {self.start_step}-{self.end_step - 1} of rank "
            f"{torch.distributed.get_rank()} written to {self.path}")

    def start(self) -> None:
        """Begin at the loop's first step (a resumed run's step count, not 0)."""
        if self._prof is None:
            return
        # the profiler counts its steps from 0; a resumed run starts at its iteration,
        # so that ProfilerStep#N names step N whatever the run resumed from
        self._prof.step_num = self.first_step
        self._prof.current_action = self._action(self.first_step)
        self._prof.start()

    def step(self) -> None:
        """One step done."""
        if self._prof is not None:
            self._prof.step()

    def stop(self) -> None:
        """The loop ended: write what the window recorded, if anything is pending."""
        if self._prof is not None:
            self._prof.stop()
            self._prof = None

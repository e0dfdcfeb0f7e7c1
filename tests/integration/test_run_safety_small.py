"""The second pass's small probes, in-process: profile traces are never overwritten,
Ctrl-C during a save names the iteration being saved, and a TOML run file's wrongly
typed values and nested tables are refused in the file's own words, and Megatron's TP
advice does not break the one-line stop."""

from __future__ import annotations

from pathlib import Path

import pytest
from hla_sp.launch.config.train_config import parse_args
from hla_sp.launch.distributed import signals
from hla_sp.launch.train.profiling import StepProfiler


class _Trace:
    """What the profiler hands its on_trace_ready: writes a trace of ``steps``."""

    def __init__(self, steps: int):
        self.steps = steps

    def export_chrome_trace(self, path: str) -> None:
        Path(path).write_text(f"{self.steps} steps")


def test_a_resumed_runs_trace_never_replaces_the_earlier_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probe 11: after a resume, rank0.steps1-3.pt.trace.json was replaced by a trace of
    fewer steps under the same name."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    path = tmp_path / "profile" / "rank0.steps1-3.pt.trace.json"
    for steps in (3, 1, 2):  # the first launch, then two resumes inside the window
        prof = StepProfiler.__new__(StepProfiler)
        prof.path, prof.start_step, prof.end_step = str(path), 1, 3
        prof._write(_Trace(steps))  # type: ignore[arg-type]
    names = sorted(p.name for p in path.parent.iterdir())
    assert names == ["rank0.steps1-3.2.pt.trace.json", "rank0.steps1-3.3.pt.trace.json",
                     "rank0.steps1-3.pt.trace.json"]
    assert path.read_text() == "3 steps"  # the first launch's, intact


def test_ctrl_c_during_a_save_names_the_iteration_being_saved() -> None:
    """Low: Ctrl-C during iteration 4's save said "during iteration 5"."""
    from hla_sp.launch.distributed import faults
    from hla_sp.launch.train.main import _interrupted_line

    stop = signals.Interrupted(2)
    with pytest.raises(signals.Interrupted), faults.saving(4):
        raise stop
    trainer = type("T", (), {"iteration": 4})()
    line = _interrupted_line(stop, trainer)  # type: ignore[arg-type]
    assert line.startswith("hla-sp train: stopped by SIGINT while saving iteration 4's "
                           "checkpoint, which is left incomplete"), line
    assert _interrupted_line(signals.Interrupted(2), trainer).startswith(  # type: ignore[arg-type]
        "hla-sp train: stopped by SIGINT during iteration 5; nothing saved")


@pytest.mark.parametrize("toml, want", [
    ('num_layers = "5"', "num_layers: expected an integer, got the string '5'; write it "
                         "without quotes"),
    ("num_layers = true", "num_layers: expected a value (an integer), got true"),
    ("fp16 = 1", "fp16: expected true or false, got 1"),
    ("[model.inner]\nx = 1", "[model.inner]: tables nest one level ([model] holds flags, not "
                             "tables); put its keys in [model]"),
])
def test_toml_values_of_the_wrong_type_are_named_in_the_files_words(
    tmp_path: Path, toml: str, want: str
) -> None:
    """Low: num_layers = "5" was accepted; true and 1 got argparse's wording; [model.inner]
    suggested min-lr."""
    f = tmp_path / "run.toml"
    f.write_text(toml + "\n")
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", str(f)])
    assert str(e.value) == f"hla_sp.launch.train: error: --config {f}: {want}"


def test_megatrons_tp_advice_does_not_break_the_one_line_stop() -> None:
    """Low: at TP 2, four lines of Megatron's CUDA_DEVICE_MAX_CONNECTIONS advice (two per
    rank) came with the one-line stop. A fresh process, as a worker: the filters are the
    trainer module's, installed when it is imported."""
    import subprocess
    import sys

    code = ("import warnings, hla_sp.launch.train.main\n"
            "warnings.warn_explicit('When using async grad allreduce it is recommended to set "
            "the environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup', "
            "UserWarning, 'layers.py', 738, module='megatron.core.tensor_parallel.layers')\n"
            "warnings.warn_explicit('another warning', UserWarning, 'x.py', 1, module='x')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in r.stderr, r.stderr
    assert "another warning" in r.stderr  # the others still show

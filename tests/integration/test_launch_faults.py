"""A dead or hung rank ends the run non-zero within a bounded time, naming the rank."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import tiny_flags
from hla_sp.launch.distributed import faults
from hla_sp.launch.distributed.local import run_local

TINY = tiny_flags(1, 64, "--train-iters", "50", "--context-parallel-size", "2")


def test_killed_rank_ends_the_others_with_its_name(tmp_path: Path) -> None:
    # rank 1 is SIGKILLed at the start of iteration 3; nothing else is wrong
    run = run_local(
        [*TINY, "--distributed-timeout-minutes", "5"],
        2,
        str(tmp_path / "m.jsonl"),
        env={"HLA_SP_FAULT": "1:3:kill"},
        timeout=240,  # the process-group timeout (5 min) is not what ends it
    )
    assert run.returncode != 0
    assert [r["iteration"] for r in run.records] == [1, 2]
    # the survivor saw its peer vanish and says which one
    assert "[hla-sp] rank 0/2: training stopped by" in run.output, run.output[-3000:]
    assert "rank(s) 1 (last finished iteration 2) stopped responding" in run.output
    # and torchrun's own summary names the dead rank as the root cause
    assert "rank      : 1" in run.output


def test_hung_rank_ends_the_others_after_the_group_timeout(tmp_path: Path) -> None:
    run = run_local(
        [*TINY, "--distributed-timeout-minutes", "0.1"],  # 6 s
        2,
        str(tmp_path / "m.jsonl"),
        env={"HLA_SP_FAULT": "1:3:hang"},
        timeout=240,
    )
    assert run.returncode != 0
    assert "Timed out" in run.output or "timeout" in run.output.lower()
    assert "rank(s) 1 (finished iteration 2, now at drills.py" in run.output, run.output[-3000:]
    assert "stuck outside the collective" in run.output


def test_sigterm_before_the_collective_fails_is_reported_as_a_peers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's SIGTERM can beat this rank's own collective error (a race with the dead
    peer's socket closing): it is then raised as an error of the peers' kind, so the
    loop prints the same 'training stopped by' line and diagnosis. Outside a process
    group it is a plain exit; during a diagnosis it waits for it."""
    monkeypatch.setattr(faults, "_diagnosing", False)  # other tests may have reported
    with monkeypatch.context() as m:
        m.setattr(faults.dist, "is_initialized", lambda: False)
        with pytest.raises(SystemExit):
            faults._on_sigterm(signal.SIGTERM, None)
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0,
                                world_size=1)
    try:
        with pytest.raises(faults.StoppedByLauncher, match="from the launcher") as info:
            faults._on_sigterm(signal.SIGTERM, None)
        assert faults._is_collective_error([info.value])
        monkeypatch.setattr(faults, "_diagnosing", True)
        assert faults._on_sigterm(signal.SIGTERM, None) is None
    finally:
        if own_group:
            dist.destroy_process_group()


def test_sigterm_while_the_traceback_prints_waits_for_the_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """torchrun's SIGTERM landing while this rank prints its traceback (which reads source
    files, slow on a loaded machine) must not cut the report short: CI once lost the
    'training stopped by' line that way."""
    monkeypatch.setattr(faults, "_diagnosing", False)
    printed = faults.traceback.print_exception

    def print_then_get_stopped(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before this returns
        printed(*args, **kwargs)

    monkeypatch.setattr(faults.traceback, "print_exception", print_then_get_stopped)
    before = signal.getsignal(signal.SIGTERM)
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0,
                                world_size=1)
    try:
        faults.install_sigterm_handler()
        try:
            raise RuntimeError("bad batch")
        except RuntimeError as err:
            faults.report_failure(0, 1, err, with_traceback=True)
    finally:
        signal.signal(signal.SIGTERM, before)
        if own_group:
            dist.destroy_process_group()
    err_text = capsys.readouterr().err
    assert "RuntimeError: bad batch" in err_text  # the traceback
    assert "[hla-sp] rank 0/1: training stopped by RuntimeError: bad batch" in err_text
    assert "this rank's own error" in err_text

"""Errors reach the user in one line, once (issue 42, item 5): the checkpoint, data and
flag checks run in ``hla-sp train`` before torchrun starts; an error of a known kind in
the workers is printed once by the launcher, without torchrun's failure summary; the
"nothing to do" hint is a command that runs as printed; tracebacks only under --debug.

The in-process tests replace ``os.execv`` so that torchrun is never started; three
tests run real two-rank jobs of a tiny model (a few seconds each)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections import namedtuple
from pathlib import Path

import pytest
import torch.distributed as dist
from ckpt_formats import without_manifest_as_format_2
from conftest import FakeStore
from hla_sp.launch import errors
from hla_sp.launch.cli.commands import main as cli_main
from hla_sp.launch.distributed import faults, signals, torchrun
from hla_sp.launch.distributed.local import worker_env

HLA_SP = os.path.join(os.path.dirname(sys.executable), "hla-sp")
TINY = ["--nproc-per-node", "2", "--context-parallel-size", "2", "--seq-length", "64",
        "--num-layers", "1", "--hidden-size", "32"]


def _hla_sp(argv: list[str], cwd: Path, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([HLA_SP, *argv], cwd=cwd, capture_output=True, text=True,
                          env=worker_env(env), timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished two-rank run of 2 iterations: ck/iter_0000002 (the schedule's decay
    length is --train-iters, 2)."""
    d = tmp_path_factory.mktemp("run")
    p = _hla_sp(["train", *TINY, "--train-iters", "2", "--save", "ck", "--load", "ck"], d)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (d / "ck" / "iter_0000002").is_dir()
    return d


@pytest.fixture
def run_dir(trained: Path, tmp_path: Path) -> Path:
    """A private copy of the finished run."""
    shutil.copytree(trained / "ck", tmp_path / "ck")
    return tmp_path


@pytest.fixture
def no_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail("torchrun was started"))


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An indexed dataset of 51 tokens (made by the project's tool): one sample of 32."""
    from hla_sp.launch.data.make_dataset import main as make_main

    d = tmp_path_factory.mktemp("small")
    (d / "in").mkdir()
    (d / "in" / "a.txt").write_text("tiny " * 10)
    assert make_main(["--input", str(d / "in"), "--output-prefix", str(d / "ds")]) == 0
    return str(d / "ds")


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# --- the launcher's preflight: refused before torchrun starts ----------------------------


@pytest.mark.parametrize(("case", "needle"), [
    ("schedule", "has another learning-rate schedule: --train-iters 2 (checkpoint) != 4"),
    ("foreign-save", "holds another run's checkpoints (iteration 2)"),
    ("ridge-inf", "--hla-ridge: expected a finite float >= 0, got inf"),
])
def test_checkpoint_and_option_checks_run_in_the_launcher(
    run_dir: Path, case: str, needle: str, no_torchrun: None,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(run_dir)
    argv = {
        "schedule": ["--train-iters", "4", "--save", "ck", "--load", "ck"],
        "foreign-save": ["--train-iters", "4", "--save", "ck"],
        "ridge-inf": ["--hla-ridge", "inf"],
    }[case]
    assert cli_main(["train", *TINY, *argv]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("hla-sp train: error: ") and needle in line, line


def test_lack_of_space_is_refused_in_the_launcher(
    tmp_path: Path, no_torchrun: None, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hla_sp.launch.checkpoint import preflight_checks

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(preflight_checks.shutil, "disk_usage", lambda p: usage(1, 1, 1000))
    assert cli_main(["train", *TINY, "--save", str(tmp_path / "ck")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "free on its filesystem, one checkpoint needs about" in line, line


@pytest.mark.parametrize(("case", "needle"), [
    ("blend-weight", "expected a number before each prefix (as 0.5 A 0.5 B) or prefixes "
                     "alone (A B), got 'x' where a weight goes"),
    ("smaller-than-a-sample", "expected at least one sample of --seq-length 64 + 1 tokens, got"),
    ("empty-validation", "--split: the valid split of --data-path"),
])
def test_data_checks_run_in_the_launcher(
    small_dataset: str, case: str, needle: str, no_torchrun: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = {
        "blend-weight": ["--data-path", "x", small_dataset, "0.5", small_dataset],
        "smaller-than-a-sample": ["--data-path", small_dataset, "--seq-length", "64"],
        # one sample of 32 tokens, which the training split takes
        "empty-validation": ["--data-path", small_dataset, "--seq-length", "32",
                             "--split", "999,1,0", "--eval-interval", "1"],
    }[case]
    flags = [*TINY[:4], "--num-layers", "1", "--hidden-size", "32"]
    assert cli_main(["train", *flags, *argv]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("hla-sp train: error: ") and needle in line, line


# --- the "nothing to do" hint --------------------------------------------------------------


def test_nothing_to_do_gives_the_flags_that_train_further(
    run_dir: Path, no_torchrun: None, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(run_dir)
    # said by the launcher, which starts nothing
    argv = ["train", *TINY, "--train-iters", "2", "--save", "ck", "--load", "ck"]
    assert cli_main(argv) == 0
    out, err = capsys.readouterr()
    assert err == ""
    line = _one_line(out)
    m = re.search(r"; to train further, rerun with: (.*?) \(a fresh cosine decay from --lr "
                  r"0\.001 to --min-lr 0\.0001 over iterations 3-4; --train-iters 4 "
                  r"--use-checkpoint-opt_param-scheduler instead keeps the checkpoint's "
                  r"schedule, at --min-lr 0\.0001\)$", line)
    assert line.startswith("nothing to do: the checkpoint in ck is at iteration 2") and m, line
    flags = m.group(1)
    assert flags == "--train-iters 4 --lr-warmup-iters 2 --override-opt_param-scheduler"
    # the run's own command with those flags set, as the line says
    q = _hla_sp(signals.edit_command(argv, set_values={
        "--train-iters": ["4"], "--lr-warmup-iters": ["2"],
        "--override-opt_param-scheduler": []}), run_dir)
    assert q.returncode == 0, q.stdout[-2000:] + q.stderr[-2000:]
    assert "iter     4/4" in q.stdout, q.stdout
    # the fresh decay: iteration 3 back at --lr (the warmup ends at the checkpoint),
    # iteration 4 half-way down the cosine to --min-lr (1e-4), where it ends
    lrs = re.findall(r"iter +\d/4 \| loss \S+ \| lr (\S+)", q.stdout)
    assert [float(x) for x in lrs] == [1e-3, 5.5e-4], q.stdout
    # and the run names what to do next
    assert "next:\n  hla-sp generate --load ck --prompt 'def ' --max-new-tokens 200\n" in q.stdout
    assert "\n  to train further, rerun with: --train-iters 8 --lr-warmup-iters 4 (" in q.stdout
    assert (run_dir / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


# --- an error in the workers: once, one line, no torchrun summary --------------------------


def _corrupt_model_state(ck: Path) -> None:
    """Truncate every rank's model state; without the file digests (a checkpoint of an
    older version), so that the read itself fails in the workers, on every rank."""
    without_manifest_as_format_2(ck / "iter_0000002")
    for f in (ck / "iter_0000002" / "model_optim").glob("*.distcp"):
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size // 2)


def test_checkpoint_read_failing_on_every_rank_is_said_once(run_dir: Path) -> None:
    _corrupt_model_state(run_dir / "ck")
    argv = ["train", *TINY, "--train-iters", "4", "--save", "ck", "--load", "ck",
            "--override-opt_param-scheduler"]
    p = _hla_sp(argv, run_dir)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    errors = [x for x in out.splitlines() if "error" in x.lower()]
    assert len(errors) == 1, out
    assert errors[0].startswith("hla-sp train: error: ") and "cannot read the model" in errors[0]
    for noise in ("Traceback", "ChildFailedError", "stopped responding", "[hla-sp] rank"):
        assert noise not in out, out


def test_debug_switch_shows_tracebacks(run_dir: Path) -> None:
    _corrupt_model_state(run_dir / "ck")
    argv = ["train", *TINY, "--train-iters", "4", "--save", "ck", "--load", "ck",
            "--override-opt_param-scheduler"]
    p = _hla_sp(argv, run_dir, {errors.DEBUG_ENV: "1"})
    assert p.returncode != 0
    assert "Traceback" in p.stderr and "cannot read the model" in p.stderr


def test_an_unexpected_worker_error_is_one_traceback_and_one_line(tmp_path: Path) -> None:
    """Issue 52, item 3: rank 1 raises an error of no known kind; the launcher prints its
    traceback once and one summary line naming rank 1 and rank 0 (which stopped after it),
    without the workers' own report lines or torchrun's ChildFailedError dump."""
    p = _hla_sp(["train", *TINY, "--train-iters", "4"], tmp_path,
                {"HLA_SP_FAULT": "1:2:raise"})
    assert p.returncode == 1, p.stdout + p.stderr
    err = p.stderr
    assert err.count("Traceback (most recent call last)") == 1, err
    for noise in ("ChildFailedError", "[hla-sp] rank", "Root Cause", "failed (exitcode"):
        assert noise not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("hla-sp train: error: rank 1/2 stopped by RuntimeError: "
                           "HLA_SP_FAULT: injected error on rank 1 at iteration 2"), err
    assert last.endswith("; rank 0 stopped after it"), err


# --- the pieces, in-process -----------------------------------------------------------------


def test_reports_of_every_rank_are_said_once(tmp_path: Path) -> None:
    for rank in (0, 1, 2):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "kind": "CheckpointError", "message": "ck: corrupt"}))
    reports = errors.read_reports(str(tmp_path))
    assert errors.summarize_reports(reports) == ["ck: corrupt"]
    (tmp_path / "rank3.json").write_text(json.dumps(
        {"rank": 3, "kind": "DatasetError", "message": "ds.bin: truncated"}))
    lines = errors.summarize_reports(errors.read_reports(str(tmp_path)))
    assert lines == ["ranks 0, 1, 2: ck: corrupt", "rank 3: ds.bin: truncated"]
    Failure = namedtuple("Failure", "exitcode")
    assert torchrun.known_failure({0: Failure(2), 1: Failure(-15)}, reports) == 2


def test_a_worker_prints_a_known_error_once_from_rank_0(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    from hla_sp.launch.checkpoint.layout import CheckpointError

    monkeypatch.delenv(errors.REPORT_ENV, raising=False)
    monkeypatch.delenv(errors.DEBUG_ENV, raising=False)
    try:
        raise CheckpointError("ck/iter_2: corrupt")
    except CheckpointError as e:
        err = e
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        faults.report_known(err)
    assert capsys.readouterr().err == "hla-sp train: error: ck/iter_2: corrupt\n"
    monkeypatch.setenv(errors.REPORT_ENV, str(tmp_path))  # under hla-sp train: to the file
    faults.report_known(err)
    assert capsys.readouterr().err == ""
    assert errors.read_reports(str(tmp_path))[0]["message"] == "ck/iter_2: corrupt"
    monkeypatch.setenv(errors.DEBUG_ENV, "1")
    faults.report_known(err)
    assert "Traceback" in capsys.readouterr().err


def test_a_peer_died_is_said_only_when_one_did(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, fake_store: FakeStore,
) -> None:
    """Both ranks fail in the same collective and stop beating: neither calls the other
    dead, since each says it failed before diagnosing."""
    store = fake_store
    monkeypatch.setattr(faults, "BEAT_S", 0.2)  # the diagnosis reads 0.6 s apart
    for r in (0, 1):  # beats that no longer move
        store.set(f"hla_sp/heartbeat/{r}", json.dumps({"beat": 3, "it": 0, "at": "x",
                                                       "coll": True}))
    ranks = [threading.Thread(target=faults.report_failure,
                              args=(r, 2, dist.DistBackendError("Connection closed by peer")))
             for r in (0, 1)]  # at the same time, as the two processes do
    for t in ranks:
        t.start()
    for t in ranks:
        t.join()
    err = capsys.readouterr().err
    assert "stopped responding" not in err, err
    # a peer that is gone without a word is still named
    store.d.pop("hla_sp/failed/1")
    faults.report_failure(0, 2, dist.DistBackendError("Connection closed by peer"))
    assert "rank(s) 1 (last finished iteration 0) stopped responding" in capsys.readouterr().err


def test_failures_are_ordered_own_error_first_then_by_time(tmp_path: Path) -> None:
    def failure(rank: int, own: bool, t: float, tb: str = "") -> errors.Failure:
        return errors.Failure(rank=rank, world_size=3, own=own, error=f"E{rank}: x",
                              where="1.0 s into iteration 2", traceback=tb, time=t,
                              lines=[f"[hla-sp] rank {rank}/3: training stopped by E{rank}: x",
                                     f"[hla-sp] rank {rank}: diagnosis: peer {rank} gone"])
    # rank 0's collective error came first in time, but rank 2's own error is the cause
    for f in (failure(0, False, 1.0), failure(2, True, 2.0, "TB2\n"), failure(1, False, 3.0)):
        assert errors.write_failure(str(tmp_path), f)
    (tmp_path / "failure9.json").write_text("{not json")  # a torn write is skipped
    found = errors.read_failures(str(tmp_path))
    assert [f.rank for f in found] == [2, 0, 1]
    text, line = errors.summarize_failures(found, "hla-sp train")
    assert text == "TB2\n"
    assert line == ("hla-sp train: error: rank 2/3 stopped by E2: x (1.0 s into iteration 2); "
                    "diagnosis: peer 2 gone; ranks 0, 1 stopped after it")


def test_a_worker_writes_its_failure_for_the_launcher(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    monkeypatch.setenv(errors.REPORT_ENV, str(tmp_path))
    monkeypatch.delenv(errors.DEBUG_ENV, raising=False)
    monkeypatch.setattr(faults, "_store", lambda: None)
    try:
        raise RuntimeError("bad batch")
    except RuntimeError as e:
        faults.report_failure(0, 1, e, with_traceback=True, advice="try less")
    assert capsys.readouterr().err == ""  # said by the launcher, not here
    (f,) = errors.read_failures(str(tmp_path))
    assert f.own and f.error == "RuntimeError: bad batch" and "raise RuntimeError" in f.traceback
    assert f.lines[-1] == "[hla-sp] rank 0: try less"

"""The long commands' progress (hla_sp.launch.progress): a bar on a terminal, a line
every HLA_SP_PROGRESS_SECONDS in a log, the ETA from the rate so far; and make-dataset
showing it (eval, export, generate and the sweep use the same class)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hla_sp.launch import progress
from hla_sp.launch.distributed.local import worker_env
from hla_sp.launch.progress import Progress


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(progress.time, "monotonic", c)
    return c


def test_log_lines_every_interval_with_eta(clock: _Clock) -> None:
    log = io.StringIO()
    bar = Progress("eval ppl-by-position", 4096, "tokens", stream=log, interval_s=30)
    clock.t += 10
    bar.advance(1024, "at 1k")  # 10 s in: quiet, a short command prints nothing
    assert log.getvalue() == ""
    clock.t += 30
    bar.advance(1024, "at 1k")  # 40 s for half: 40 s to go
    assert log.getvalue() == ("eval ppl-by-position: 50% (2.05k/4.10k tokens), elapsed 40s, "
                              "ETA 40s, at 1k\n")
    clock.t += 40
    bar.advance(2048)  # done: the command's own result line follows, not another
    bar.close()
    assert log.getvalue().count("\n") == 1


def test_terminal_bar_redrawn_in_place(clock: _Clock) -> None:
    term = _Terminal()
    with Progress("generate", 400, "tokens", stream=term) as bar:
        clock.t += 1
        bar.advance(100)
        assert term.getvalue() == ("\r\033[K[######..................] generate: 25% "
                                   "(100/400 tokens), elapsed 1s, ETA 3s")
        bar.say("a result line", stream=term)  # the bar leaves the line, then comes back
        assert term.getvalue().endswith("\r\033[Ka result line\n\r\033[K[######.........."
                                        "........] generate: 25% (100/400 tokens), elapsed "
                                        "1s, ETA 3s")
    assert term.getvalue().endswith("\n")  # closed: the last state stays on its line


def test_disabled_and_empty_say_nothing(clock: _Clock) -> None:
    out = _Terminal()
    for bar in (Progress("x", 10, stream=out, enabled=False), Progress("x", 0, stream=out)):
        clock.t += 100
        bar.advance(5)
        bar.close()
    assert out.getvalue() == ""


def test_make_dataset_shows_progress_in_a_log(tmp_path: Path, capsys: pytest.CaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("megatron.core")
    from hla_sp.launch.data.make_dataset import main

    for i in range(3):
        (tmp_path / f"{i}.txt").write_bytes(b"x" * 1000)
    monkeypatch.setenv(progress.INTERVAL_ENV, "0")  # every step a line
    assert main(["--input", str(tmp_path), "--output-prefix", str(tmp_path / "out" / "d")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [re.sub(r"elapsed .*", "", x) for x in err] == [
        "make-dataset: 33% (1.00k/3.00k bytes), ", "make-dataset: 67% (2.00k/3.00k bytes), "]
    assert all(re.search(r"elapsed \d+s, ETA \d+s$", x) for x in err), err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-process run of 2 iterations, positions none (any length decodes)."""
    pytest.importorskip("megatron.core")
    d = tmp_path_factory.mktemp("progress")
    hla_sp = os.path.join(os.path.dirname(sys.executable), "hla-sp")
    p = subprocess.run([hla_sp, "train", "--nproc-per-node", "1", "--num-layers", "1",
                        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
                        "64", "--train-iters", "2", "--position-embedding-type", "none",
                        "--save", str(d / "ck")], capture_output=True, text=True,
                       env=worker_env(None), timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return d / "ck"


@pytest.mark.parametrize(("argv", "label"), [
    (["generate", "--prompt", "x", "--max-new-tokens", "300", "--no-stop-at-eod"],
     "generate: "),
    (["eval", "--task", "ppl-by-position", "--lengths", "128,256", "--samples", "2"],
     "eval ppl-by-position: "),
])
def test_long_commands_write_progress_lines_to_a_log(checkpoint: Path, tmp_path: Path,
                                                     argv: list[str], label: str) -> None:
    """Through the console script, stderr a pipe: lines with an ETA."""
    hla_sp = os.path.join(os.path.dirname(sys.executable), "hla-sp")
    p = subprocess.run([hla_sp, *argv, "--load", str(checkpoint)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600,
                       env=worker_env({progress.INTERVAL_ENV: "0"}))
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [x for x in p.stderr.splitlines() if x.startswith(label)]
    assert lines and all(re.search(r"\d+% \(.*\), elapsed \d+s, ETA \d+s", x) for x in lines), (
        p.stderr[-2000:])

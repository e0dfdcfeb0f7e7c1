"""The long commands' progress (hla_sp.launch.progress): a bar on a terminal, a line
every HLA_SP_PROGRESS_SECONDS in a log, the ETA from the rate so far; and make-dataset
showing it (eval, export, generate and the sweep use the same class)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from hla_sp.launch import progress
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
    from hla_sp.launch.make_dataset import main

    for i in range(3):
        (tmp_path / f"{i}.txt").write_bytes(b"x" * 1000)
    monkeypatch.setenv(progress.INTERVAL_ENV, "0")  # every step a line
    assert main(["--input", str(tmp_path), "--output-prefix", str(tmp_path / "out" / "d")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [re.sub(r"elapsed .*", "", x) for x in err] == [
        "make-dataset: 33% (1.00k/3.00k bytes), ", "make-dataset: 67% (2.00k/3.00k bytes), "]
    assert all(re.search(r"elapsed \d+s, ETA \d+s$", x) for x in err), err

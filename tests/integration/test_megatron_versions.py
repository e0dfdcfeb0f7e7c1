"""``hla-sp train``, ``eval``, ``export`` and ``generate`` on every megatron-core the
``megatron`` extra admits (issue 52).

The trainer was tested only on megatron-core 0.16.1 (Python 3.11) and failed at its
first batch on 0.18+, which Python 3.12 users install by default. Here each release of
``TESTED_VERSIONS`` past 0.16.1 runs in the Python 3.12 environment that
``make setup-megatron`` builds (the Python 3.11 suite covers 0.16.1): CP 2 with
``--use-distributed-optimizer``, stopped at iteration 2 and resumed, gives CP 1's losses;
then ``eval``, ``export`` and ``generate`` read its checkpoint. Also: the version range
is one fact (compat, the Makefile, pyproject, the pretrain tests agree), older releases
are refused and newer ones warned about, and the CP split has one caller.

Without the environment these tests skip, except under CI, where they fail.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ci_env import MCORE_DIR, PY312, ROOT, require_megatron
from conftest import tiny_flags
from hla_sp.launch.errors import ConfigError
from hla_sp.launch.extras import require
from hla_sp.megatron_patch import compat

PY312_VERSIONS = compat.TESTED_VERSIONS[1:]  # 0.16.1 is the Python 3.11 environment's
TINY = tiny_flags(2, 64, "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters",
    "4", "--lr", "3e-3", "--lr-warmup-iters", "1", "--seed", "5")


def _hla_sp(version: str, cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``hla-sp ARGV`` with the Python 3.12 environment and megatron-core ``version``."""
    require_megatron(version)
    env = dict(os.environ, PYTHONPATH=str(MCORE_DIR / version), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    return subprocess.run([str(PY312), "-m", "hla_sp.launch.cli", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def _ok(p: subprocess.CompletedProcess[str], what: str) -> str:
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{what}: exit {p.returncode}\n{out[-6000:]}"
    assert "Traceback" not in out, f"{what}\n{out[-6000:]}"
    return out


def _losses(jsonl: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in jsonl.read_text().splitlines() if x.strip()]
    return {r["iteration"]: r["loss"] for r in rows if "event" not in r}


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("version", PY312_VERSIONS)
def test_trainer_eval_export_generate(version: str, tmp_path: Path) -> None:
    train = ["train", *TINY, "--log-jsonl"]
    _ok(_hla_sp(version, tmp_path, *train, "cp1.jsonl", "--nproc-per-node", "1"), "CP 1")
    cp2 = [*train, "cp2.jsonl", "--nproc-per-node", "2", "--context-parallel-size", "2",
           "--use-distributed-optimizer", "--save", "ck", "--load", "ck",
           "--save-interval", "2"]
    _ok(_hla_sp(version, tmp_path, *cp2, "--exit-interval", "2"), "CP 2 to iteration 2")
    out = _ok(_hla_sp(version, tmp_path, *cp2), "CP 2 resumed")
    assert "resum" in out.lower(), out[-3000:]
    a, b = _losses(tmp_path / "cp1.jsonl"), _losses(tmp_path / "cp2.jsonl")
    assert sorted(a) == [1, 2, 3, 4] and sorted(b) == [1, 2, 3, 4], (a, b)
    # CP 2 splits the sequence and the optimizer state: fp32 sums in another order
    assert all(abs(a[i] - b[i]) <= 1e-5 * abs(a[i]) for i in a), (a, b)

    _ok(_hla_sp(version, tmp_path, "eval", "--load", "ck", "--task", "ppl-by-position",
                "--lengths", "64", "--samples", "1", "--nproc-per-node", "2",
                "--output", "ev"), "eval")
    assert (tmp_path / "ev").is_dir() and any((tmp_path / "ev").glob("*.json"))
    _ok(_hla_sp(version, tmp_path, "export", "--load", "ck", "--output", "hf"), "export")
    assert (tmp_path / "hf" / "config.json").is_file()
    out = _ok(_hla_sp(version, tmp_path, "generate", "--load", "ck", "--prompt", "hi",
                      "--max-new-tokens", "4", "--top-k", "1"), "generate")
    assert "tokens/s" in out


def test_the_tested_range_is_one_fact() -> None:
    """compat.TESTED_VERSIONS is what the Makefile installs, what pyproject admits, what
    Megatron's own pretrain() is tested on, and (first) this Python 3.11 environment's."""
    make = (ROOT / "Makefile").read_text()
    m = re.search(r"^MCORE_VERSIONS\s*\?=\s*(.+)$", make, re.M)
    assert m and tuple(m.group(1).split()) == PY312_VERSIONS, m and m.group(1)
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["megatron"]
    assert extras == [f"megatron-core>={compat.TESTED_VERSIONS[0]},"
                      f"<={compat.TESTED_VERSIONS[-1]}"], extras
    import test_megatron_pretrain

    assert tuple(test_megatron_pretrain.VERSIONS) == PY312_VERSIONS
    assert compat.installed_version() == compat.TESTED_VERSIONS[0]


@pytest.mark.parametrize("version, outcome", [
    ("0.15.3", "refused"), ("0.16.0", "refused"), ("0.16.1", None), ("0.18.0", None),
    ("0.19.2", None), ("0.19.3", "untested"), ("0.20.0rc1", "untested"), ("1.0", "untested"),
])
def test_older_releases_are_refused_and_newer_ones_warned(version: str, outcome: str | None
                                                           ) -> None:
    if outcome == "refused":
        with pytest.raises(ValueError, match=rf"^megatron-core: expected >= 0\.16\.1 .*, "
                                             rf"got {re.escape(version)}: pip install"):
            compat.version_check(version)
    elif outcome == "untested":
        assert compat.version_check(version).startswith(
            f"megatron-core {version} is newer than the newest release hla-sp is tested on")
    else:
        assert compat.version_check(version) is None


def test_commands_refuse_an_old_release_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(compat, "installed_version", lambda: "0.15.0")
    with pytest.raises(ConfigError, match=r"expected >= 0\.16\.1"):
        require("megatron", "hla-sp train")
    monkeypatch.setattr(compat, "installed_version", lambda: "0.21.0")
    monkeypatch.setattr(compat, "_warned", set())
    monkeypatch.setenv("RANK", "0")
    require("megatron", "hla-sp train")
    require("megatron", "hla-sp train")  # said once
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("hla-sp train: warning: megatron-core 0.21.0"), err
    monkeypatch.setattr(compat, "_warned", set())
    monkeypatch.setenv("RANK", "1")  # a worker: rank 0 says it
    require("megatron", "hla-sp train")
    assert capsys.readouterr().err == ""


def test_one_cp_split() -> None:
    """Every caller of Megatron's ``get_batch_on_this_cp_rank`` goes through
    ``compat.cp_split`` (its signature changed in 0.18, and cp_group=None means WORLD)."""
    callers = []
    for folder in ("hla_sp", "launch", "megatron_patch", "kernels"):
        for f in (ROOT / folder).rglob("*.py"):
            if f.name != "compat.py" and re.search(
                    r"import get_batch_on_this_cp_rank|get_batch_on_this_cp_rank\(",
                    f.read_text()):
                callers.append(str(f.relative_to(ROOT)))
    assert callers == [], callers

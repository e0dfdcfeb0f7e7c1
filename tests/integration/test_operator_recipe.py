"""docs/operators.md's worked example, as written: its module saved as ``my_ops.py``,
its shell commands run in that directory (train at CP 2 with ``--custom-import``, then
generate from the checkpoint), its layer snippet run; and the same operator registered
as first-order is refused by ``--attention`` in one line that says why."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from hla_sp.launch.distributed.local import worker_env

ROOT = Path(__file__).resolve().parents[2]


def _section() -> tuple[list[str], list[str]]:
    """The worked example's python blocks and its shell commands (continuations joined)."""
    text = (ROOT / "docs" / "operators.md").read_text()
    section = text.split("## A worked example\n", 1)[1].split("\n## ", 1)[0]
    python = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    bash = [line for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)
            for line in re.sub(r"\\\n\s*", " ", block).splitlines() if line.strip()]
    return python, bash


def _env(d: Path) -> dict[str, str]:
    env = worker_env(None)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def test_worked_example_as_written(tmp_path: Path) -> None:
    python, bash = _section()
    assert len(python) == 2 and len(bash) == 2, (len(python), bash)
    (tmp_path / "my_ops.py").write_text(python[0])
    train, sample = bash
    assert train.startswith("PYTHONPATH=. hla-sp train --custom-import my_ops --attention qqv")
    p = subprocess.run(train, shell=True, cwd=tmp_path, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "done" in p.stdout + p.stderr
    p = subprocess.run(sample, shell=True, cwd=tmp_path, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and p.stdout.startswith("def "), p.stderr[-3000:]
    p = subprocess.run([sys.executable, "-c", python[1]], cwd=tmp_path,
                       env={**_env(tmp_path), "PYTHONPATH": "."}, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]


def test_first_order_operator_refused_with_why(tmp_path: Path) -> None:
    python, _ = _section()
    first = python[0].replace('"qqv"', '"qqv1"').replace("higher_order=True",
                                                         "higher_order=False")
    assert "higher_order=False" in first
    (tmp_path / "my_ops1.py").write_text(first)
    p = subprocess.run(["hla-sp", "train", "--custom-import", "my_ops1", "--attention", "qqv1"],
                       cwd=tmp_path, env={**_env(tmp_path), "PYTHONPATH": "."},
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 2 and p.stdout == "", p.stdout
    assert p.stderr == (
        "hla-sp train: error: argument --attention: 'qqv1' is a first-order operator (its "
        "OperatorSpec has higher_order=False), and the core-attention slot takes only "
        "higher-order ones: hla2, ahla, hla3, ccq (hla-sp train --help lists every flag)\n"
    ), p.stderr

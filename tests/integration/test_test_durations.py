"""Every pytest run keeps its tests' durations (tests/conftest.py), slowest first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_run_writes_its_durations_slowest_first(tmp_path: Path) -> None:
    case = ROOT / "tests" / f"_durations_case_{os.getpid()}.py"  # under tests/: its conftest
    case.write_text("import time\n\ndef test_fast():\n    pass\n\n"
                    "def test_slow():\n    time.sleep(0.3)\n")
    out = tmp_path / "d.json"
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            str(case)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, HLA_SP_TEST_DURATIONS=str(out)))
    finally:
        case.unlink()
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out.read_text())
    assert rows["exitstatus"] == 0
    names = [t["nodeid"].rsplit("::", 1)[1] for t in rows["tests"]]
    assert names == ["test_slow", "test_fast"], rows
    assert rows["tests"][0]["seconds"] >= 0.3

"""Under CI a missing tool or environment fails a test instead of skipping it: a suite
that passes there must have run everything it claims to."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The Python 3.12 environment `make setup-megatron` builds, one megatron-core per folder
PY312 = Path(os.environ.get("HLA_SP_VENV312", ROOT / ".venv312")) / "bin" / "python"
MCORE_DIR = Path(os.environ.get("HLA_SP_MCORE_DIR", ROOT / ".mcore"))


def in_ci() -> bool:
    """Whether this is CI (``CI`` set to anything but empty, 0, false or no)."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def skip_or_fail(msg: str) -> None:
    """Skip with ``msg``; under CI, fail with it."""
    if in_ci():
        pytest.fail(msg + " (CI: these tests must run)")
    pytest.skip(msg)


def require_megatron(version: str) -> None:
    """Skip (fail under CI) unless the 3.12 environment with this version is built."""
    missing = [str(p) for p in (PY312, MCORE_DIR / version / "megatron" / "training")
               if not p.exists()]
    if missing:
        skip_or_fail(f"megatron-core {version} for Python 3.12 is not set up "
                     f"({', '.join(missing)} missing); run `make setup-megatron`")

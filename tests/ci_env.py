"""Under CI a missing tool or environment fails a test instead of skipping it: a suite
that passes there must have run everything it claims to."""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    """Whether this is CI (``CI`` set to anything but empty, 0, false or no)."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def skip_or_fail(msg: str) -> None:
    """Skip with ``msg``; under CI, fail with it."""
    if in_ci():
        pytest.fail(msg + " (CI: these tests must run)")
    pytest.skip(msg)

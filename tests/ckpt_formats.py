"""Checkpoints of older formats, made from new ones (for tests of what older files get)."""

from __future__ import annotations

from pathlib import Path

import torch


def without_manifest_as_format_2(d: Path) -> None:
    """Make iteration directory ``d`` a format-2 checkpoint without file digests: format 2
    may predate manifests, so a missing manifest.json there is a warning, not a refusal."""
    (d / "manifest.json").unlink(missing_ok=True)
    common = torch.load(d / "common.pt", weights_only=True)
    common["format"] = 2
    torch.save(common, d / "common.pt")

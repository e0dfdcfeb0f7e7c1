"""The Megatron loop's softmax baseline on SDPA (benchmarks/megatron_sdpa.py) is the same
model as Megatron's own local softmax layer: equal losses, on CPU (megatron-core 0.19.2,
the Python 3.12 environment of tests/integration/test_megatron_pretrain.py; skips without it)."""

from __future__ import annotations

import os

import pytest
from test_megatron_pretrain import MCORE_DIR, ROOT, SHIM, close, ok, pretrain

VERSION = "0.19.2"
NORM = ("--normalization", "RMSNorm")  # the spec's norm, as the lease's runs use


@pytest.mark.timeout(600)
def test_sdpa_spec_trains_like_megatrons_softmax_layer():
    r_ref, ref = pretrain(VERSION, 1, *NORM)
    ok(r_ref, ref, "softmax (DotProductAttention)")
    path = os.pathsep.join(str(p) for p in (SHIM, MCORE_DIR / VERSION, ROOT / "benchmarks"))
    r, got = pretrain(VERSION, 1, *NORM, "--spec", "megatron_sdpa", "sdpa_layer_spec",
                      env_extra=dict(PYTHONPATH=path))
    ok(r, got, "softmax (SDPA spec)")
    out = r.stdout + r.stderr
    assert "HLA attention in" not in out
    assert "> softmax core attention: SDPAFlashAttention, backend MATH" in out  # it ran
    assert close(got, ref), (ref, got)

"""The layer-traffic model (benchmarks/layer_traffic.py): its premise, bytes per token
that do not depend on T, and its attribution of the backward to forward lines."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import layer_traffic as L


def test_bytes_per_token_do_not_depend_on_T(monkeypatch) -> None:
    monkeypatch.delenv("HLA_SP_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    small, large = (L.record(T, hidden=256, heads=2) for T in (64, 256))
    # the interpreter and the Triton backend were the model's only: the caller's are back
    import os

    assert "HLA_SP_BACKEND" not in os.environ and os.environ["TRITON_INTERPRET"] == "0"
    for phase in ("forward", "backward"):
        a, b = sum(small[phase].values()), sum(large[phase].values())
        # what does not scale with T (weights, per-head parameters) is small against it
        assert abs(a - b) <= 0.1 * b, (phase, a, b)
    # the backward is attributed to the forward's lines: the convolution's among them
    assert any("nn/conv.py" in k for k in large["backward"])
    r = L.report(large, hidden=256, heads=2, lengths=(1024,))
    row = r["rows"][0]
    assert row["torch_gb"] > 0 and row["kernels_gb"] > 0
    assert 0 < r["kb_per_token"]["conv_backward"] < r["kb_per_token"]["backward"]

"""``hla-sp export`` of a model with rotary positions, on a machine without CUDA.

The trainer refuses RoPE on a CPU (megatron-core's rotary embedding moves to the current
CUDA device), but a GPU run's checkpoint is often exported on a CPU host. RoPE has no
parameters, so a checkpoint of a run without positions, its config.json saying rope,
is such a checkpoint: export must write it, its check must pass, and the exported model
must rotate (its logits differ from the export of the same weights without positions).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")  # the reference is Megatron's own model

from hla_sp.launch.distributed.local import worker_env
from hla_sp.launch.export import command as export
from hla_sp.launch.export import generate as gen
from hla_sp.megatron_patch.compat import rotary_on_host

HLA_SP = os.path.join(os.path.dirname(sys.executable), "hla-sp")
# fp32, the same operations on the same weights (see test_hf_export.py): 0 measured
REL = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny run without positions, and a copy whose config.json says rope."""
    d = tmp_path_factory.mktemp("rope")
    none = d / "none"
    p = subprocess.run([HLA_SP, "train", "--num-layers", "2", "--hidden-size", "32",
                        "--num-attention-heads", "2", "--seq-length", "64", "--train-iters",
                        "2", "--position-embedding-type", "none", "--save", str(none)],
                       capture_output=True, text=True, env=worker_env(None), timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rope = d / "rope"
    shutil.copytree(none, rope)
    it = rope / "iter_0000002"
    cfg = json.loads((it / "config.json").read_text())
    cfg["model"]["position_embedding_type"] = "rope"
    (it / "config.json").write_text(json.dumps(cfg))
    raw = (it / "config.json").read_bytes()
    man = json.loads((it / "manifest.json").read_text())
    man["files"]["config.json"] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (it / "manifest.json").write_text(json.dumps(man))
    return {"none": none, "rope": rope}


def _export(ckpt: Path, out: Path) -> str:
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        code = export.main(["--load", str(ckpt), "--output", str(out)])
    assert code == 0 and e.getvalue() == "", e.getvalue()
    return o.getvalue()


def test_rope_exports_and_rotates(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    import hla_sp.hf  # noqa: F401 (registers the Auto classes)

    line = _export(checkpoints["rope"], tmp_path / "rope")
    assert "logits checked: max difference" in line, line
    _export(checkpoints["none"], tmp_path / "none")
    cfg = json.loads((tmp_path / "rope" / "config.json").read_text())
    assert cfg["position_embedding_type"] == "rope"
    ids = torch.randint(0, 257, (1, 40), generator=torch.Generator().manual_seed(5))
    with gen.single_process(), rotary_on_host(), torch.no_grad():
        model, _ = gen.load_model(str(checkpoints["rope"]), decodable=False)
        want = model(ids, torch.arange(40)[None], None)[0, :, :257]
    hf = {k: AutoModelForCausalLM.from_pretrained(tmp_path / k).eval() for k in ("rope", "none")}
    with torch.no_grad():
        got = {k: m(ids).logits[0] for k, m in hf.items()}
    scale = want.abs().max()
    assert (got["rope"] - want).abs().max() <= REL * scale
    # the rotation changes the logits by their own size (position 0 is not rotated)
    assert (got["rope"] - got["none"])[1:].abs().max() > 100 * REL * scale
    assert torch.equal(got["rope"][0], got["none"][0])


def test_generate_still_refuses_rope(checkpoints: dict[str, Path]) -> None:
    """generate's one-token forward would rotate at position 0: refused in one line."""
    with pytest.raises(gen.GenerateError, match="rope"):
        gen.load_config(str(checkpoints["rope"]))

"""Megatron-LM's own ``pretrain()`` with HLA, megatron-core 0.17.1, 0.18.0 and 0.19.2.

Each run is ``python -m hla_sp.megatron_patch.pretrain_gpt --attention hla2 ...`` (under
``torch.distributed.run`` for several ranks) in the Python 3.12 environment that
``make setup-megatron`` builds (.venv312/ plus .mcore/<version>/), on CPU with gloo,
3 iterations of mock data. tests/megatron_cpu/ is put on PYTHONPATH: its
sitecustomize lets Megatron run without CUDA (a test helper, not part of hla_sp).

Checked for the <= 0.17 API (0.17.1) and the newest (0.19.2): the HLA check passes;
CP = 2 reproduces CP = 1's losses within 1e-5; a softmax run of the same model gives
other losses; a hybrid stack trains at CP = 1. On 0.19.2 also TP = 2 x CP = 2 (4 ranks);
on 0.18.0 (its own pretrain API) CP = 2 against CP = 1. On 0.19.2 also
``--reset-attention-mask`` (each document's logits independent of the documents before
it, at CP = 1 and 2) and a padded vocabulary (-inf logits at the padding ids), read from
the logits the test shim records (``HLA_SP_TEST_LOGITS``).

Without the environment these tests skip, except under CI (``CI`` set and not
"false"/"0"), where they fail: CI must run them.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
from ci_env import MCORE_DIR, PY312, ROOT, require_megatron

SHIM = ROOT / "tests" / "megatron_cpu"
# version -> the pretrain API it has (hla_sp.megatron_patch.compat.pretrain_api)
VERSIONS = {"0.17.1": "legacy", "0.18.0": "provider", "0.19.2": "config"}
ITERS = 3

BASE = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
    "--global-batch-size", "2", "--train-iters", str(ITERS), "--lr", "1e-3", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--make-vocab-size-divisible-by", "1", "--seed", "1234",
    # what the CPU shim needs (see tests/megatron_cpu/sitecustomize.py)
    "--distributed-backend", "gloo", "--rerun-mode", "disabled", "--use-cpu-initialization",
    "--transformer-impl", "local", "--clip-grad", "0",
    # fusions are torch.compile'd or CUDA kernels: off, so that a run takes seconds
    "--no-gradient-accumulation-fusion", "--no-bias-dropout-fusion",
    "--no-masked-softmax-fusion", "--no-persist-layer-norm", "--no-rope-fusion",
    "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
    "--attention-dropout", "0", "--hidden-dropout", "0",
    "--position-embedding-type", "learned_absolute", "--log-interval", "1",
    "--eval-iters", "0", "--eval-interval", "1000", "--num-workers", "0",
]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+)")


require = require_megatron


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pretrain(version: str, nproc: int, *argv: str, base: list[str] = BASE,
             env_extra: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, list]:
    """Run the entry point; returns the process and the logged losses (iteration order)."""
    require(version)
    port = str(free_port())
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(SHIM), str(MCORE_DIR / version)]),
        HLA_SP_MEGATRON_CPU_SHIM="1", CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
    )
    env.update(env_extra or {})  # may replace PYTHONPATH (a --spec module's folder added)
    entry = ["-m", "hla_sp.megatron_patch.pretrain_gpt", *base, *argv]
    if nproc == 1:  # the command as a user types it
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        cmd = [str(PY312), *entry]
    else:
        cmd = [str(PY312), "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", port, *entry]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env, cwd=ROOT)
    out = r.stdout + r.stderr
    losses = {int(i): float(x) for i, x in LOSS.findall(out)}
    return r, [losses[i] for i in sorted(losses)]


def ok(r: subprocess.CompletedProcess, losses: list, what: str) -> list:
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, f"{what}: exit {r.returncode}\n{tail}"
    assert len(losses) == ITERS, f"{what}: {ITERS} losses expected, got {losses}\n{tail}"
    return losses


_RUNS: dict[tuple, tuple] = {}


def run_once(version: str, nproc: int, *argv: str) -> tuple[subprocess.CompletedProcess, list]:
    """:func:`pretrain`, each command once per session (several tests read the same run)."""
    key = (version, nproc, *argv)
    if key not in _RUNS:
        _RUNS[key] = pretrain(version, nproc, *argv)
    return _RUNS[key]


HLA = ("--attention", "hla2")
CP2 = ("--context-parallel-size", "2")


def close(a: list, b: list, tol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


@pytest.mark.timeout(900)
# 0.17's legacy API also runs in the hybrid-stack test below; its full CP check is slow.
@pytest.mark.parametrize("version", [pytest.param("0.17.1", marks=pytest.mark.slow), "0.19.2"])
def test_real_pretrain_hla_cp2_equals_cp1_and_differs_from_softmax(version):
    r1, cp1 = run_once(version, 1, *HLA)
    ok(r1, cp1, f"{version} HLA CP=1")
    out = r1.stdout + r1.stderr
    assert "> HLA attention in 2 layer(s): ['hla2']" in out  # the model check passed
    assert f"megatron.training.pretrain: the '{VERSIONS[version]}' API" in out
    r2, cp2 = run_once(version, 2, *HLA, *CP2)
    ok(r2, cp2, f"{version} HLA CP=2")
    assert (r2.stdout + r2.stderr).count("> HLA attention in 2 layer(s)") == 2  # both ranks
    assert close(cp2, cp1), (cp1, cp2)
    rs, soft = run_once(version, 1)
    ok(rs, soft, f"{version} softmax CP=1")
    assert "HLA attention" not in rs.stdout + rs.stderr
    assert all(abs(x - y) > 1e-4 for x, y in zip(soft, cp1)), (soft, cp1)
    assert cp1[-1] < cp1[0] and soft[-1] < soft[0], (cp1, soft)  # it trains


@pytest.mark.timeout(900)
def test_real_pretrain_018_provider_api_trains():
    """0.18's pretrain takes a config container and a model_provider (a third API)."""
    r1, cp1 = run_once("0.18.0", 1, *HLA)
    ok(r1, cp1, "0.18.0 HLA CP=1")
    assert "megatron.training.pretrain: the 'provider' API" in r1.stdout + r1.stderr
    assert cp1[-1] < cp1[0], cp1


# CP through the provider API: the same groups as 0.19's config API, whose CP=2 run is
# checked above, so this one is slow (another 30 s pretrain).
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_pretrain_018_provider_api_cp2_equals_cp1():
    _, cp1 = run_once("0.18.0", 1, *HLA)
    r2, cp2 = run_once("0.18.0", 2, *HLA, *CP2)
    ok(r2, cp2, "0.18.0 HLA CP=2")
    assert close(cp2, cp1), (cp1, cp2)


# TP = 2 x CP = 2 through our core attention is checked on megatron-core itself in
# tests/unit/megatron_patch/test_megatron_cp.py::test_tp2_cp2_matches_tp1_cp1; via Megatron's own
# pretrain() (4 ranks, about 60 s) it is slow.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_pretrain_tp2_cp2_equals_tp1_cp1():
    """4 gloo ranks: TP = 2 x CP = 2. The batch is broadcast over the TP group and split
    over the CP group (an explicit group: None means WORLD from 0.18)."""
    # The defaults, short convolution included (its taps are cut by heads over TP).
    r1, ref = run_once("0.19.2", 1, *HLA)
    ok(r1, ref, "0.19.2 HLA TP=1 CP=1")
    r4, tpcp = run_once("0.19.2", 4, *HLA, *CP2, "--tensor-model-parallel-size", "2")
    ok(r4, tpcp, "0.19.2 HLA TP=2 CP=2")
    assert close(tpcp, ref), (ref, tpcp)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("version", ["0.17.1", "0.19.2"])
def test_real_pretrain_hybrid_stack_cp1(version):
    """--hla-layer-pattern 2 on 2 layers: HLA then softmax, and it trains; on 0.19 its
    losses are neither run's. The block spec goes through our model_provider (0.17) and
    the model config (0.19)."""
    r, hybrid = run_once(version, 1, *HLA, "--hla-layer-pattern", "2")
    ok(r, hybrid, f"{version} hybrid")
    out = r.stdout + r.stderr
    assert "hybrid stack, HLA where the pattern says 1: [1, 0]; layers: ['hla2', " \
           "'DotProductAttention']" in out, out[-3000:]
    assert hybrid[-1] < hybrid[0], hybrid  # it trains
    if version != "0.19.2":
        return  # the built layers are checked above; the losses once (0.19's runs exist)
    _, hla = run_once(version, 1, *HLA)
    _, soft = run_once(version, 1)
    for other in (hla, soft):
        assert all(abs(x - y) > 1e-4 for x, y in zip(hybrid, other)), (hybrid, other)


@pytest.mark.timeout(300)
def test_real_pretrain_refuses_mtp_before_training():
    """A bypass flag stops the real entry point with status 2 before Megatron starts."""
    r, losses = pretrain("0.19.2", 1, *HLA, "--mtp-num-layers", "1")
    assert r.returncode == 2 and not losses, (r.stdout + r.stderr)[-3000:]
    assert "--mtp-num-layers 1 with --attention hla2" in r.stderr


def test_versions_match_the_makefile():
    """The versions tested here are the ones `make setup-megatron` installs."""
    line = next(ln for ln in (ROOT / "Makefile").read_text().splitlines()
                if ln.startswith("MCORE_VERSIONS"))
    assert line.split("=", 1)[1].split() == list(VERSIONS)


def test_missing_environment_fails_under_ci(monkeypatch, tmp_path):
    """CI must not skip these tests silently: a missing environment is a failure there."""
    import ci_env

    monkeypatch.setattr(ci_env, "PY312", tmp_path / "none" / "python")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI: these tests must run"):
        require("0.19.2")
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="make setup-megatron"):
        require("0.19.2")


# --reset-attention-mask: byte-level documents (EOD 256 = NullTokenizer's eod at
# --vocab-size 257 on 0.19), a file of them, and a run that records its first logits.
RESET = ("--reset-attention-mask", "--reset-position-ids")
DATA_BASE = [a for a in BASE if a != "--mock-data"] + [
    "--vocab-size", "257", "--split", "1,0,0"]


def _documents(prefix: Path, changed: bool) -> str:
    """Twenty documents of 6-20 bytes, one per line; ``changed``: every 4th holds other
    bytes of the same lengths, so every sample keeps its layout and only they differ."""
    import random

    from hla_sp.launch.data.make_dataset import make_dataset

    rnd, other = random.Random(0), random.Random(1)
    lines = []
    for i in range(20):
        n = rnd.randint(6, 20)
        text = "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))
        if changed and i % 4 == 0:
            text = "".join(other.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(n))
        lines.append("x" + text)  # never blank: each line is one document
    prefix.parent.mkdir(parents=True, exist_ok=True)
    src = prefix.parent / "docs.txt"
    src.write_text("\n".join(lines) + "\n")
    make_dataset([str(src)], str(prefix), split_lines=True)
    return str(prefix)


def _logits_run(tmp: Path, name: str, changed: bool, nproc: int, *argv: str) -> list[dict]:
    """A 0.19.2 run on the documents; every rank's first (tokens, positions, logits)."""
    import torch

    out = tmp / f"{name}-logits"
    out.mkdir()
    data = _documents(tmp / name / "docs", changed)
    r, losses = pretrain("0.19.2", nproc, *HLA, *RESET, "--data-path", data,
                         "--data-cache-path", str(tmp / name / "cache"), *argv,
                         base=DATA_BASE, env_extra={"HLA_SP_TEST_LOGITS": str(out)})
    ok(r, losses, f"0.19.2 {name}")
    return [torch.load(out / f"rank{i}.pt") for i in range(nproc)]


def _segments(tokens: Any) -> Any:
    """[b, s] -> the index of each token's document in its row (a new one after an EOD)."""
    import torch

    after_eod = torch.zeros_like(tokens)
    after_eod[:, 1:] = (tokens[:, :-1] == 256).long()
    return after_eod.cumsum(1)


@pytest.mark.timeout(900)
def test_real_pretrain_reset_attention_mask_isolates_documents(tmp_path):
    """``--reset-attention-mask --reset-position-ids`` with HLA, through Megatron's own
    pretrain(): the first step's logits of every document that did not change are those of
    the run where the documents before it hold other bytes (fp32 rounding at most: 2e-5 of
    the largest logit); at CP = 2 (documents crossing the zigzag chunks) the same logits.
    Before, HLA ignored the flag and such a document moved by about 0.5."""
    import torch

    a = _logits_run(tmp_path, "a", False, 1)[0]
    b = _logits_run(tmp_path, "b", True, 1)[0]
    assert torch.equal(a["position_ids"], b["position_ids"])
    seg = _segments(a["tokens"])
    assert torch.equal(a["position_ids"] == 0, torch.cat(
        [torch.ones_like(seg[:, :1]), seg[:, 1:] != seg[:, :-1]], 1).bool())  # reset ids
    changed = a["tokens"] != b["tokens"]
    hit = torch.zeros_like(changed)  # the tokens of a document holding a changed byte
    for row in range(seg.shape[0]):
        for d in seg[row].unique():
            at = seg[row] == d
            hit[row, at] = changed[row, at].any()
    # the probe: untouched tokens that come after a changed document in their row
    probe = ~hit & (hit.long().cumsum(1) > 0)
    assert probe.sum() > 10, (probe.sum(), a["tokens"])
    scale = a["logits"].abs().max().item()
    diff = (a["logits"] - b["logits"]).abs().amax(-1)
    assert diff[~hit].max() <= 2e-5 * scale, diff[probe]
    assert diff[hit].max() > 1e-2  # the changed documents did change
    # CP = 2: rank r holds chunks r and 3 - r of 4; put them back in order
    cp = _logits_run(tmp_path, "cp2", False, 2, *CP2)
    n = a["tokens"].shape[1] // 4
    whole = torch.empty_like(a["logits"])
    for r, d in enumerate(cp):
        for half, chunk in enumerate((r, 3 - r)):
            whole[:, chunk * n:(chunk + 1) * n] = d["logits"][:, half * n:(half + 1) * n]
    assert (whole - a["logits"]).abs().max() <= 2e-5 * scale


@pytest.mark.timeout(600)
def test_real_pretrain_padding_ids_take_no_probability(tmp_path):
    """Megatron pads --vocab-size 100 to 128 (--make-vocab-size-divisible-by 128): the
    entry point's model gives the 28 padding ids -inf logits, so Megatron's own loss is the
    softmax over the real ids (before, they took probability and moved the loss)."""
    import torch

    out = tmp_path / "logits"
    out.mkdir()
    r, losses = pretrain("0.19.2", 1, *HLA, "--vocab-size", "100",
                         "--make-vocab-size-divisible-by", "128",
                         env_extra={"HLA_SP_TEST_LOGITS": str(out)})
    ok(r, losses, "0.19.2 padded vocabulary")
    logits = torch.load(out / "rank0.pt")["logits"]
    assert logits.shape[-1] == 128
    assert torch.isneginf(logits[..., 100:]).all()
    assert torch.isfinite(logits[..., :100]).all()

"""lm-eval on an exported model: its figures are the model's own log-likelihoods.

A tiny ``hla-sp train`` run is exported, and lm-eval's CLI runs the local tasks of
``tests/data/lm_eval`` on it as docs/eval.md writes the command (offline: the JSONL
files ship with the tests). Every log-likelihood lm-eval logs must be the sum of the
exported model's own log-probabilities of the scored tokens, and every figure it
reports must follow from those sums as lm-eval defines it.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("lm_eval")

from hla_sp.launch.distributed.local import worker_env as _env
from hla_sp.launch.export import command as export

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "lm_eval"
HLA_SP = os.path.join(os.path.dirname(sys.executable), "hla-sp")
LM_EVAL = os.path.join(os.path.dirname(sys.executable), "lm_eval")
EOD = 256
# Each log-likelihood is a sum of at most 64 fp32 log-probabilities of one sign, so the
# rounding of lm-eval's fp32 sum against this test's fp64 one is below 64 x 6e-8 of it;
# the logits themselves come from the same model on the same ids (batch size 1).
REL = 1e-5


def _doc_lm_eval(export_dir: Path, out: Path) -> tuple[dict[str, str], list[str]]:
    """docs/eval.md's first lm_eval command (its leading VAR=value words as the
    environment), with the model and output paths of this test."""
    text = (ROOT / "docs" / "eval.md").read_text()
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = shlex.split(line.split(" #")[0])
            env = {}
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                key, value = words.pop(0).split("=", 1)
                env[key] = value
            if words[:1] == ["lm_eval"]:
                argv = [a.replace("runs/demo/hf", str(export_dir))
                        .replace("runs/demo/lm_eval", str(out)) for a in words]
                assert str(export_dir) in " ".join(argv) and str(out) in argv, argv
                return env, argv
    raise AssertionError("docs/eval.md: no lm_eval command")


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A trained, exported model and lm-eval's results and samples on it."""
    d = tmp_path_factory.mktemp("lm_eval")
    p = subprocess.run([HLA_SP, "train", "--num-layers", "2", "--hidden-size", "32",
                        "--num-attention-heads", "4", "--seq-length", "128",
                        "--micro-batch-size", "4", "--train-iters", "30", "--lr", "1e-2",
                        "--seed", "3", "--save", str(d / "ckpt")],
                       capture_output=True, text=True, env=_env(None), timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert export.main(["--load", str(d / "ckpt"), "--output", str(d / "hf")]) == 0
    env, argv = _doc_lm_eval(d / "hf", d / "out")
    assert env.get("HF_DATASETS_OFFLINE") == "1" and env.get("HF_HUB_OFFLINE") == "1"
    # a private cache: nothing read from, or left in, the user's
    env.update(HF_HOME=str(d / "hf_home"))
    p = subprocess.run([LM_EVAL, *argv[1:]], capture_output=True, text=True,
                       env=_env(env), cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (results,) = glob.glob(str(d / "out" / "*" / "results_*.json"))
    samples = {}
    for task in ("hla_sp_choice", "hla_sp_ppl"):
        (path,) = glob.glob(str(d / "out" / "*" / f"samples_{task}_*.jsonl"))
        samples[task] = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return {"dir": d / "hf", "results": json.loads(Path(results).read_text())["results"],
            "samples": samples, "table": p.stdout}


def _jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def own(evaluated: dict) -> dict:
    """The exported model's own summed log-probabilities: of each choice after its
    context, and of each text after the end-of-document token (lm-eval's prefix)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(evaluated["dir"], trust_remote_code=True)

    def logprob(prefix: bytes | list[int], scored: bytes) -> float:
        ids = torch.tensor([[*prefix, *scored]])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids[:, :-1]).logits[0].double(), -1)
        n = len(prefix)
        return float(sum(lp[n - 1 + i, b] for i, b in enumerate(scored)))

    choice = [[logprob(d["context"].encode(), c.encode()) for c in d["choices"]]
              for d in _jsonl("hla_sp_choice.jsonl")]
    ppl = [logprob([EOD], d["text"].encode()) for d in _jsonl("hla_sp_ppl.jsonl")]
    return {"choice": choice, "ppl": ppl}


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL)


def test_every_loglikelihood_is_the_models_own(evaluated: dict, own: dict) -> None:
    docs = _jsonl("hla_sp_choice.jsonl")
    got = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]]
           for s in evaluated["samples"]["hla_sp_choice"]}
    assert sorted(got) == list(range(len(docs)))
    for i, want in enumerate(own["choice"]):
        assert all(_close(a, b) for a, b in zip(got[i], want, strict=True)), (i, got[i], want)
    got_ppl = {s["doc_id"]: float(s["filtered_resps"][0])
               for s in evaluated["samples"]["hla_sp_ppl"]}
    assert sorted(got_ppl) == list(range(len(own["ppl"])))
    for i, want in enumerate(own["ppl"]):
        assert _close(got_ppl[i], want), (i, got_ppl[i], want)


def test_reported_figures_follow_from_them(evaluated: dict, own: dict) -> None:
    res = evaluated["results"]
    docs = _jsonl("hla_sp_choice.jsonl")
    # acc: the likeliest choice is the right one; acc_norm: per character of the choice
    acc = [max(range(len(ll)), key=ll.__getitem__) == d["label"]
           for ll, d in zip(own["choice"], docs, strict=True)]
    norm = [max(range(len(ll)), key=lambda j: ll[j] / len(d["choices"][j])) == d["label"]
            for ll, d in zip(own["choice"], docs, strict=True)]
    assert res["hla_sp_choice"]["acc,none"] == pytest.approx(sum(acc) / len(acc), abs=1e-12)
    assert res["hla_sp_choice"]["acc_norm,none"] == pytest.approx(sum(norm) / len(norm),
                                                                  abs=1e-12)
    texts = [d["text"] for d in _jsonl("hla_sp_ppl.jsonl")]
    total = sum(own["ppl"])
    nbytes = sum(len(t.encode()) for t in texts)
    words = sum(len(re.split(r"\s+", t)) for t in texts)  # lm-eval's word count
    ppl = res["hla_sp_ppl"]
    assert _close(ppl["bits_per_byte,none"], -total / nbytes / math.log(2))
    assert _close(ppl["byte_perplexity,none"], math.exp(-total / nbytes))
    assert _close(ppl["word_perplexity,none"], math.exp(-total / words))
    # the table the command prints names both tasks
    assert "hla_sp_choice" in evaluated["table"] and "bits_per_byte" in evaluated["table"]


def test_the_trained_model_beats_chance(own: dict) -> None:
    """30 steps on Python sources already make Python text likelier than a uniform guess
    over the 257 ids (8.006 bits per byte; 4.94 measured here; a model of 3 steps,
    nearly its random start, scores 7.95)."""
    nbytes = sum(len(d["text"].encode()) for d in _jsonl("hla_sp_ppl.jsonl"))
    bits = -sum(own["ppl"]) / nbytes / math.log(2)
    assert bits < 6.5, bits

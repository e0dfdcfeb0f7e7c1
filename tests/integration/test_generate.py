"""``hla-sp generate``: decoding with each layer's state equals the full forward.

The decode is exact, not approximate: a prefill (chunk-parallel) and then one-token
forwards that continue each HLA layer's recurrent state give the logits of one forward
over the whole sequence, in fp64 to 1e-10 of the largest logit (the two differ only in
the order of the operator's sums: chunks of 64 against one step per token). Then the
sampling, the checkpoint loading and the command's one-line errors.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from hla_sp.launch.export import generate as gen
from hla_sp.megatron_patch import get_hla_layer_local_spec

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 64
TOL = 1e-10  # fp64, relative to the largest logit


def _gpt(operator: str, seq: int, groups: int, **hla):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=groups,
        ffn_hidden_size=64, use_cpu_initialization=True, attention_dropout=0.0,
        hidden_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
    )
    torch.manual_seed(0)
    model = GPTModel(config=cfg, transformer_layer_spec=get_hla_layer_local_spec(operator, **hla),
                     vocab_size=VOCAB, max_sequence_length=seq,
                     position_embedding_type="learned_absolute").double().eval()
    with torch.no_grad():
        # the first-order mixes start at zero; non-zero ones make the higher-order
        # terms count, and random gains make the per-head norms do something
        for name, p in model.named_parameters():
            if name.endswith(("key_mix", "value_mix", "norm_weight", "decay_weight")):
                p.copy_(torch.rand_like(p) + 0.5)
    return model


@pytest.fixture(scope="module")
def single():
    warnings.simplefilter("ignore")
    with gen.single_process():
        yield


CASES = [  # (operator, kv groups, HLA options): GQA on hla2; the short conv on in both
    ("hla2", 2, dict(decay="data", short_conv=4)),
    ("linear", 4, dict(decay="learned", short_conv=4)),
]


@pytest.mark.parametrize("operator,groups,hla", CASES, ids=[c[0] for c in CASES])
def test_decode_with_state_equals_full_forward(single, operator, groups, hla):
    T, prefill = 40, 13
    model = _gpt(operator, T, groups, **hla)
    x = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x, torch.arange(T)[None], None)  # [1, T, vocab]
    scale = float(full.abs().max())
    for first in (prefill, 1):  # a prefill, then steps; and token by token from the start
        with gen.Decoder(model) as dec:
            parts = [dec.advance(x[:, :first])]
            parts += [dec.advance(x[:, t : t + 1]) for t in range(first, T)]
        err = float((torch.cat(parts, 1) - full).abs().max())
        assert err <= TOL * scale, (operator, first, err, scale)
    # the state is left on the model only inside the context manager
    assert all(core.recurrent is None for core in dec.cores)


def test_generate_greedy_equals_argmax_of_full_forwards(single):
    model = _gpt("hla2", 32, 2, decay="data", short_conv=4)
    prompt = [5, 9, 1, 60, 7]
    got = gen.generate(model, prompt, max_new_tokens=12, temperature=0.0, stop_at_eod=False)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(12):  # the quadratic way: the whole sequence again per token
            logits = model(torch.tensor([seq]), torch.arange(len(seq))[None], None)[0, -1]
            seq.append(int(logits[: gen.BYTE_VOCAB].argmax()))
    assert got.tokens == seq[len(prompt):]
    assert got.prompt_tokens == len(prompt)
    with pytest.raises(gen.GenerateError, match="need 36 positions, the model has 32"):
        gen.generate(model, prompt, max_new_tokens=32)


def test_sample():
    logits = torch.zeros(384)
    logits[300] = 50.0  # a padded id: never drawn
    logits[7], logits[9] = 3.0, 2.9
    assert gen.sample(logits, 0.0, 0, None) == 7
    g = torch.Generator().manual_seed(0)
    assert {gen.sample(logits, 1.0, 1, g) for _ in range(20)} == {7}
    assert {gen.sample(logits, 1.0, 2, g) for _ in range(200)} == {7, 9}
    a = [gen.sample(logits, 5.0, 0, torch.Generator().manual_seed(3)) for _ in range(3)]
    b = [gen.sample(logits, 5.0, 0, torch.Generator().manual_seed(3)) for _ in range(3)]
    assert a == b and max(a) < gen.BYTE_VOCAB
    assert gen.prompt_ids("") == [gen.EOD] and gen.prompt_ids("é") == [0xC3, 0xA9]


# ------------------------------------------------------------------ checkpoints, command


def _train_config(*flags: str):
    from hla_sp.launch.config.train_config import parse_args

    return parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
                       "4", "--seq-length", "64", "--attention", "hla2", *flags])


def _save(root: Path, cfg) -> None:
    """A checkpoint as the trainer writes it (weights, config.json, latest)."""
    from hla_sp.launch import checkpoint
    from hla_sp.launch.model.build import build_model

    class _Sched:
        def state_dict(self) -> dict:
            return {}

    torch.manual_seed(0)
    model = build_model(cfg, gen.BYTE_VOCAB)
    checkpoint.save(str(root), 3, rank=0, world_size=1, tp_rank=0, writes_model=True,
                    model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    scheduler=_Sched(), consumed_samples=0, config=cfg.to_dict())


@pytest.fixture(scope="module")
def ckpt(single, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gen") / "ckpt"
    _save(root, _train_config("--context-parallel-size", "2"))  # any CP size loads
    return root


def test_main_prints_prompt_and_continuation(ckpt, capsys):
    argv = ["--load", str(ckpt), "--prompt", "ab", "--max-new-tokens", "6",
            "--temperature", "0", "--no-stop-at-eod"]
    assert gen.main(argv) == 0
    out, err = capsys.readouterr()
    model, _ = gen.load_model(str(ckpt))
    want = gen.generate(model, [97, 98], 6, stop_at_eod=False).tokens
    text = bytes(t if t < 256 else 10 for t in want).decode("utf-8", errors="replace")
    assert len(want) == 6 and out == "ab" + text + "\n"
    assert "prefill 2 tokens" in err and "decoded 6 tokens" in err


@pytest.mark.parametrize("case,match", [
    ("missing", "no such directory"),
    ("empty", "no complete checkpoint there"),
    ("softmax", "expected HLA attention in every layer .*got --attention softmax"),
    ("wider", r"position_embeddings.weight is \(64, 32\) in the checkpoint, this model's is "
              r"\(64, 48\)"),
    ("temperature", "--temperature: expected >= 0"),
    ("tokens", "--max-new-tokens: the prompt .* need 70 positions, the model has 64"),
])
def test_main_errors_in_one_line(ckpt, tmp_path, capsys, case, match):
    load, extra = tmp_path / "c", []
    if case == "missing":
        load = tmp_path / "nowhere"
    elif case == "empty":
        load.mkdir()
    elif case in ("softmax", "wider"):
        _save(load, _train_config())
        cfg_path = load / "iter_0000003" / "config.json"
        saved = json.loads(cfg_path.read_text())
        if case == "softmax":
            saved["model"]["attention"] = "softmax"
        else:
            saved["model"]["hidden_size"] = 48
        cfg_path.write_text(json.dumps(saved))
        # a consistent checkpoint whose config does not fit its weights: record the
        # edited file's digest, or the manifest check refuses it first
        man_path = load / "iter_0000003" / "manifest.json"
        man = json.loads(man_path.read_text())
        raw = cfg_path.read_bytes()
        man["files"]["config.json"] = {"size": len(raw),
                                       "sha256": hashlib.sha256(raw).hexdigest()}
        man_path.write_text(json.dumps(man))
    else:
        load = ckpt
        extra = (["--temperature", "-1"] if case == "temperature"
                 else ["--prompt", "x" * 60, "--max-new-tokens", "11"])
    assert gen.main(["--load", str(load), *extra]) == 2
    out, err = capsys.readouterr()
    err = err.strip()
    assert out == ""  # refused before the prompt is printed
    assert "\n" not in err and err.startswith("hla-sp generate: error: "), err
    assert re.search(match, err), err


def test_console_script_generate(ckpt):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    p = subprocess.run(
        [sys.executable, "-m", "hla_sp.launch.cli", "generate", "--load", str(ckpt),
         "--prompt", "hi", "--max-new-tokens", "4", "--temperature", "0.7", "--top-k", "5"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("hi") and "tokens/s" in p.stderr

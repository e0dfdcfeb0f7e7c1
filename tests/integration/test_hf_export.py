"""``hla-sp export``: checkpoints of real ``hla-sp train`` runs as Hugging Face models.

Two tiny runs of two processes (gloo), one at context parallelism 2 and one at tensor
parallelism 2 with GQA, are exported as docs/eval.md writes the command; each export
loads with ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` (in a
fresh process, which imports nothing of hla-sp itself) and gives the logits of the
checkpoint loaded in one process as ``hla-sp generate`` loads it. Then bf16, the
output directory's rules, the one-line errors, a run with a Hugging Face BPE tokenizer
and one of a user's operator (--custom-import).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import tiny_flags

pytest.importorskip("megatron.core")

from hla_sp.launch.distributed.local import worker_env as _env
from hla_sp.launch.export import command as export
from hla_sp.launch.export import generate as gen

from hla_sp.config import HLAConfig

ROOT = Path(__file__).resolve().parents[2]
HLA_SP = os.path.join(os.path.dirname(sys.executable), "hla-sp")
TINY = tiny_flags(2, 64, "--train-iters", "3", "--micro-batch-size", "2", "--lr", "3e-3",
    "--seed", "7")
RUNS = {  # the layouts that save: each a different sharding of the same whole tensors
    "cp2": ["--context-parallel-size", "2", "--position-embedding-type", "none"],
    "tp2": ["--tensor-model-parallel-size", "2", "--num-query-groups", "2"],
}
# fp32: the HF model and Megatron's run the same operations on the same weights; only
# the summation order of a matrix product may differ (0 measured here, ~1e-7 relative
# expected at worst for sums of 32-128 terms). A misplaced tensor or head moves the
# logits by their own size.
REL = 1e-5


def _documented_export(load: Path, out: Path) -> list[str]:
    """docs/eval.md's ``hla-sp export`` command as written, on this test's paths."""
    text = (ROOT / "docs" / "eval.md").read_text()
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            if line.startswith("hla-sp export "):
                subs = {"runs/demo/ckpt": str(load), "runs/demo/hf": str(out)}
                argv = [subs.get(a, a) for a in shlex.split(line.split(" #")[0])]
                assert str(load) in argv and str(out) in argv, argv
                return argv
    raise AssertionError("docs/eval.md: no hla-sp export command")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints of ``hla-sp train --nproc-per-node 2`` at CP 2 and at TP 2."""
    d = tmp_path_factory.mktemp("export")
    out = {}
    for name, flags in RUNS.items():
        ckpt = d / name
        p = subprocess.run([HLA_SP, "train", "--nproc-per-node", "2", *TINY, *flags,
                            "--save", str(ckpt)],
                           capture_output=True, text=True, env=_env(None), timeout=600)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        out[name] = ckpt
    return out


@pytest.fixture(scope="module")
def exported(runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hf")
    out = {}
    for name, ckpt in runs.items():
        if name == "cp2":  # as docs/eval.md writes the command
            p = subprocess.run([HLA_SP, *_documented_export(ckpt, d / name)[1:]],
                               capture_output=True, text=True, env=_env(None), cwd=ROOT,
                               timeout=600)
            assert p.returncode == 0, p.stderr
            stdout, stderr = p.stdout, p.stderr
        else:  # in this process: the same command without a second interpreter's imports
            o, e = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
                assert export.main(["--load", str(ckpt), "--output", str(d / name)]) == 0
            stdout, stderr = o.getvalue(), e.getvalue()
        assert stderr == "" and re.fullmatch(
            rf"hla-sp export: {re.escape(str(d / name))}: hla2 GPT, 2 layers x 32 hidden, "
            r"vocabulary 257 \(bytes\), fp32; logits checked: max difference \S+ of the "
            r"largest\n", stdout), stdout
        out[name] = d / name
    return out


def _probe(n: int = 48) -> torch.Tensor:
    return torch.randint(0, 257, (1, n), generator=torch.Generator().manual_seed(3))


def _checkpoint_logits(ckpt: Path, ids: torch.Tensor, vocab: int = 257) -> torch.Tensor:
    """The logits [T, vocab] of the checkpoint loaded in one process (hla-sp generate's
    loader: any TP/CP layout resharded into whole tensors)."""
    warnings.simplefilter("ignore")
    with gen.single_process():
        model, _ = gen.load_model(str(ckpt))
        with torch.no_grad():
            return model(ids, torch.arange(ids.shape[1])[None], None)[0, :, :vocab].float()


# A fresh interpreter: nothing of hla-sp imported, only each directory's auto_map.
_REMOTE = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
ids, out = torch.load(sys.argv[1]), {}
for d in sys.argv[3:]:
    model = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(d, trust_remote_code=True)
    with torch.no_grad():
        logits = model(ids).logits[0]
    enc = tok("h\u00e9 <|endoftext|>").input_ids
    out[d] = {"logits": logits, "dtype": str(model.dtype), "ids": enc, "text": tok.decode(enc),
              "eos": tok.eos_token_id, "cls": type(model).__name__}
assert "hla_sp.launch" not in sys.modules and "megatron" not in sys.modules, "imported"
torch.save(out, sys.argv[2])
"""


@pytest.fixture(scope="module")
def remote(exported: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What a fresh process loads from each export with trust_remote_code=True."""
    d = tmp_path_factory.mktemp("remote")
    torch.save(_probe(), d / "ids.pt")
    p = subprocess.run([sys.executable, "-c", _REMOTE, str(d / "ids.pt"), str(d / "got.pt"),
                        *(str(exported[n]) for n in RUNS)],
                       capture_output=True, text=True, env=_env({"HF_HUB_OFFLINE": "1"}),
                       cwd=d, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = torch.load(d / "got.pt")
    return {n: got[str(exported[n])] for n in RUNS}


@pytest.mark.parametrize("name", list(RUNS))
def test_export_equals_the_checkpoint_with_trust_remote_code(
    runs: dict[str, Path], remote: dict, name: str
) -> None:
    got = remote[name]
    want = _checkpoint_logits(runs[name], _probe())
    assert got["cls"] == "HLASPForCausalLM" and got["dtype"] == "torch.float32"
    err = float((got["logits"] - want).abs().max())
    assert err <= REL * float(want.abs().max()), (name, err)
    # the byte tokenizer: UTF-8 bytes, and a literal end-of-text marker is its bytes too
    assert got["ids"] == list("hé <|endoftext|>".encode()) and got["text"] == "hé <|endoftext|>"
    assert got["eos"] == 256


def test_config_and_files(exported: dict[str, Path], runs: dict[str, Path]) -> None:
    d = exported["tp2"]
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json",
            "configuration_hla_sp.py", "modeling_hla_sp.py", "tokenization_hla_sp.py"} <= set(
        os.listdir(d)), os.listdir(d)
    assert not [n for n in os.listdir(d.parent) if ".tmp-" in n or ".old-" in n]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "hla_sp" and cfg["architectures"] == ["HLASPForCausalLM"]
    assert cfg["auto_map"] == {
        "AutoConfig": "configuration_hla_sp.HLASPConfig",
        "AutoModel": "modeling_hla_sp.HLASPModel",
        "AutoModelForCausalLM": "modeling_hla_sp.HLASPForCausalLM",
        "AutoTokenizer": ["tokenization_hla_sp.HLASPByteTokenizer", None]}
    assert (cfg["vocab_size"], cfg["num_key_value_heads"], cfg["dtype"]) == (257, 2, "float32")
    # every HLA option, as the run's layers had it
    saved = json.loads((runs["tp2"] / "iter_0000003" / "config.json").read_text())
    assert {f"hla_{f.name}" for f in dataclasses.fields(HLAConfig)} <= set(cfg)
    assert cfg["hla_operator"] == saved["model"]["attention"] == "hla2"
    assert cfg["hla_chunk_size"] == saved["hla"]["chunk_size"]
    gen_cfg = json.loads((d / "generation_config.json").read_text())
    assert gen_cfg["eos_token_id"] == 256 == cfg["eod_token_id"]
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        emb = f.get_tensor("model.embed_tokens.weight")
    # the padded rows (TP 2 pads 257 to 512) are gone; the tied output layer is not stored
    assert emb.shape == (257, 32) and "lm_head.weight" not in keys
    assert "from hla_sp.hf" in (d / "modeling_hla_sp.py").read_text()  # the package's code


def test_loads_without_trust_remote_code_after_import(exported: dict[str, Path],
                                                      runs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hla_sp.hf

    model = AutoModelForCausalLM.from_pretrained(exported["cp2"])
    assert type(model) is hla_sp.hf.HLASPForCausalLM
    ids = _probe(40)
    with torch.no_grad():
        got = model(ids).logits[0]
    want = _checkpoint_logits(runs["cp2"], ids)
    assert float((got - want).abs().max()) <= REL * float(want.abs().max())
    tok = AutoTokenizer.from_pretrained(exported["cp2"])
    assert tok("ab").input_ids == [97, 98] and tok.eos_token_id == 256


def test_bf16_export(runs: dict[str, Path], exported: dict[str, Path], tmp_path: Path,
                     capsys: pytest.CaptureFixture) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import hla_sp.hf  # noqa: F401

    out = tmp_path / "bf16"
    assert export.main(["--load", str(runs["cp2"]), "--output", str(out), "--dtype", "bf16"]) == 0
    assert "bf16; logits checked" in capsys.readouterr().out
    half, full = load_file(out / "model.safetensors"), load_file(
        exported["cp2"] / "model.safetensors")
    assert sorted(half) == sorted(full)
    for k in half:  # each weight is the fp32 export's, rounded once to bf16
        assert half[k].dtype == torch.bfloat16 and torch.equal(half[k], full[k].bfloat16()), k
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


def test_force_replaces_an_earlier_export_only(runs: dict[str, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "hf"
    argv = ["--load", str(runs["tp2"]), "--output", str(out), "--no-verify"]
    assert export.main(argv) == 0
    (out / "stale.txt").write_text("from an earlier export")
    assert export.main(argv) == 2  # not empty: refused, untouched
    assert "--force replaces this earlier export" in capsys.readouterr().err
    assert export.main([*argv, "--force"]) == 0
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # nothing left beside it


def _main(argv: list[str]) -> int:
    """export.main's exit status, whether it returns or exits (argparse's errors)."""
    try:
        return export.main(argv)
    except SystemExit as e:
        return int(e.code or 0)


@pytest.mark.parametrize("case,match", [
    ("no-load", r"the following arguments are required: --load"),
    ("file", r"--output \S+: expected a directory \(new or empty\), got a file"),
    ("dtype", r"argument --dtype: invalid choice: 'fp16' \(choose from '?bf16'?, '?fp32'?\)"),
    ("other-dir", r"--output \S+ --force: expected an earlier export there .*left untouched"),
    ("no-ckpt", r"--load \S+: no such directory"),
    ("empty-ckpt", r"--load \S+: no complete checkpoint there"),
])
def test_errors_are_one_line(runs: dict[str, Path], tmp_path: Path, case: str, match: str,
                             capsys: pytest.CaptureFixture) -> None:
    out, ckpt = tmp_path / "out", str(runs["cp2"])
    extra: list[str] = []
    if case == "file":
        out.write_text("x")
    elif case == "dtype":
        extra = ["--dtype", "fp16"]
    elif case == "other-dir":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        extra = ["--force"]
    elif case == "no-ckpt":
        ckpt = str(tmp_path / "nowhere")
    elif case == "empty-ckpt":
        (tmp_path / "empty").mkdir()
        ckpt = str(tmp_path / "empty")
    before = sorted(os.listdir(tmp_path))
    argv = ([] if case == "no-load" else ["--load", ckpt]) + ["--output", str(out), *extra]
    assert _main(argv) == 2
    o, err = capsys.readouterr()
    err = err.strip()
    assert o == "" and "\n" not in err and err.startswith("hla-sp export: error: "), err
    assert re.search(match, err), err
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, nothing half-written
    if case == "other-dir":
        assert os.listdir(out) == ["notes.txt"]


def test_missing_extra_is_one_line(runs: dict[str, Path], tmp_path: Path, monkeypatch:
                                   pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from hla_sp.launch import extras

    monkeypatch.setattr(extras, "installed", lambda m: m != "transformers")
    assert _main(["--load", str(runs["cp2"]), "--output", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == ('hla-sp export: error: hla-sp export needs transformers, '
                                       'which is not installed: pip install "hla-sp[hf]"\n')
    assert os.listdir(tmp_path) == []


def test_custom_operator_exports_and_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture) -> None:
    """A run of a user's operator (--custom-import): export imports the module the run
    recorded, and the model loads wherever that module is imported; without it, one line."""
    from hla_sp.launch.config.train_config import parse_args
    from test_custom_import import USER_MODULE
    from test_generate import _save
    from transformers import AutoModelForCausalLM

    from hla_sp.ops import operators

    (tmp_path / "qqv_user_op.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        cfg = parse_args([*TINY, "--custom-import", "qqv_user_op", "--attention", "qqv"])
        warnings.simplefilter("ignore")
        with gen.single_process():
            _save(tmp_path / "ckpt", cfg)
        out = tmp_path / "hf"
        assert _main(["--load", str(tmp_path / "ckpt"), "--output", str(out)]) == 0
        assert "qqv GPT" in capsys.readouterr().out
        assert json.loads((out / "config.json").read_text())["hla_operator"] == "qqv"
        ids = _probe(24)
        with torch.no_grad():
            got = AutoModelForCausalLM.from_pretrained(out)(ids).logits[0]
        want = _checkpoint_logits(tmp_path / "ckpt", ids)
        assert float((got - want).abs().max()) <= REL * float(want.abs().max())
    finally:
        operators.unregister("qqv")
        sys.modules.pop("qqv_user_op", None)
    (tmp_path / "qqv_user_op.py").unlink()  # the module is gone: refused in one line
    capsys.readouterr()  # (the load's progress bar)
    assert _main(["--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--custom-import qqv_user_op: cannot import it" in err, err


def test_console_script_help() -> None:
    h = subprocess.run([HLA_SP, "export", "--help"], capture_output=True, text=True,
                       env=_env(None), timeout=300)
    assert h.returncode == 0 and "--dtype" in h.stdout and "--force" in h.stdout


# --- a run with a Hugging Face tokenizer ------------------------------------------------

TEXT = ["def area(width, height):\n    return width * height\n",
        "for name in names:\n    print(name.upper())\n",
        "class Stack:\n    def push(self, item):\n        self.items.append(item)\n"]


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A byte-level BPE tokenizer trained here (``<eos>`` ends documents), data made with
    it by make-dataset, a 3-step run on that data, and its export."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("bpe")
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(TEXT * 4, trainers.BpeTrainer(
        vocab_size=290, special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>").save_pretrained(d / "tok")
    (d / "docs").mkdir()
    for i, t in enumerate(TEXT):
        (d / "docs" / f"{i}.txt").write_text(t * 30)
    from hla_sp.launch.data.make_dataset import main as make_dataset

    # in this process where no torchrun is needed (each new process imports for seconds)
    assert make_dataset(["--input", str(d / "docs"), "--output-prefix", str(d / "data"),
                         "--tokenizer", str(d / "tok")]) == 0
    p = subprocess.run([HLA_SP, "train", "--nproc-per-node", "1", *TINY, "--data-path",
                        str(d / "data"), "--tokenizer", str(d / "tok"), "--save", str(d / "ckpt")],
                       capture_output=True, text=True, env=_env(None), timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert export.main(["--load", str(d / "ckpt"), "--output", str(d / "hf")]) == 0
    return {"tok": d / "tok", "ckpt": d / "ckpt", "hf": d / "hf"}


def test_export_with_the_runs_hf_tokenizer(bpe_run: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = bpe_run["hf"]
    cfg = json.loads((hf / "config.json").read_text())
    # transformers has the tokenizer's class: no code for it, nothing in auto_map
    assert "AutoTokenizer" not in cfg["auto_map"] and not (hf / "tokenization_hla_sp.py").exists()
    assert (cfg["vocab_size"], cfg["eod_token_id"]) == (290, 0)
    tok = AutoTokenizer.from_pretrained(hf, trust_remote_code=True)
    ref = AutoTokenizer.from_pretrained(bpe_run["tok"])
    text = "def push(self, width):\n    return name"
    assert tok(text).input_ids == ref(text).input_ids and tok.eos_token_id == 0
    model = AutoModelForCausalLM.from_pretrained(hf, trust_remote_code=True)
    ids = torch.tensor([tok(text).input_ids])
    with torch.no_grad():
        got = model(ids).logits[0]
    want = _checkpoint_logits(bpe_run["ckpt"], ids, vocab=290)
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= REL * float(want.abs().max())

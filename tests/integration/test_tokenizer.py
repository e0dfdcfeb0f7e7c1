"""The run's tokenizer: bytes by default, or a Hugging Face tokenizer, end to end.

A tokenizer is trained here on a few strings (the ``tokenizers`` library: byte-level
BPE, ``<eos>`` its one special token) and saved as a ``save_pretrained`` directory and as
a bare tokenizer.json; nothing is downloaded. With it: ``hla-sp make-dataset
--tokenizer`` (as docs/launch.md writes it), a tiny ``hla-sp train`` on that data whose
checkpoint records the tokenizer, and ``hla-sp generate`` on the checkpoint, greedy,
whose text is the tokenizer's decode of the model's own argmax ids and whose first
stderr line names the iteration and the validation loss. Then the byte tokenizer (the
launcher's and the Hugging Face class) round trips, and the one-line errors.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_flags
from hla_sp.launch.data import tokenizer as T
from hla_sp.launch.distributed.local import worker_env as _env

ROOT = Path(__file__).resolve().parents[2]
HLA_SP = os.path.join(os.path.dirname(sys.executable), "hla-sp")
CORPUS = ["the quick brown fox jumps over the lazy dog", "héllo wörld, the fox says hi",
          "déjà vu 😀 again and again", "a lazy dog sleeps; the brown fox runs away"]
# a character the tokenizer never saw: its three UTF-8 bytes are three ids, so the
# stream decoder must hold the first two back
UNSEEN = "漢"
TEXT = "the fox: déjà 😀 héllo\nnew " + UNSEEN
TINY = tiny_flags(2, 32, "--micro-batch-size", "2", "--lr", "3e-3", "--seed", "7")


def _run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([HLA_SP, *argv], capture_output=True, text=True, env=_env(None),
                          cwd=cwd or ROOT, timeout=600)


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A byte-level BPE tokenizer trained here: {"dir": save_pretrained, "json": bare}."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("tok")
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(CORPUS * 3, trainer)
    tk.save(str(d / "tokenizer.json"))
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>").save_pretrained(d / "hf")
    return {"dir": str(d / "hf"), "json": str(d / "tokenizer.json")}


# --- the interface ---------------------------------------------------------------------


def test_byte_tokenizer_round_trip() -> None:
    tok = T.load_tokenizer(None)
    assert (tok.name, tok.vocab_size, tok.eod) == ("bytes", 257, 256)
    assert T.load_tokenizer("bytes").name == "bytes"
    text = "héllo\x00 wörld 😀 <|endoftext|> " + UNSEEN
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text
    # an end of document is a new line, in the decode and in the stream alike
    ids2 = [*ids, tok.eod, *ids[:3]]
    stream = tok.stream()
    assert "".join(stream.add(i) for i in ids2) + stream.flush() == tok.decode(ids2)
    assert tok.decode(ids2) == text + "\n" + "hé"
    assert tok.encode_document(b"\xff\xfe", "x") == [255, 254]  # any bytes


def test_hf_byte_tokenizer_matches_and_saves(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    import hla_sp.hf  # noqa: F401  (registers the tokenizer with AutoTokenizer)
    from hla_sp.hf.tokenization import HLASPByteTokenizer

    run = T.load_tokenizer(None)
    text = "héllo\x00 wörld 😀 <|endoftext|> " + UNSEEN
    files = run.save_pretrained(str(tmp_path))
    assert any(f.endswith("tokenizer_config.json") for f in files)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(tok, HLASPByteTokenizer)
    # the same ids as make-dataset writes: a literal "<|endoftext|>" is its 13 bytes
    assert tok.encode(text) == run.encode(text)
    assert (tok.eos_token_id, tok.pad_token_id, len(tok)) == (256, 256, 257)
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([104, 105, 256], skip_special_tokens=True) == "hi"
    assert tok.decode([0xE6, 0xBC]) == "\ufffd"  # a cut character is U+FFFD, not an error


@pytest.mark.parametrize("form", ["dir", "json"])
def test_hf_tokenizer_encode_decode_stream(hf_tok: dict[str, str], form: str) -> None:
    tok = T.load_tokenizer(hf_tok[form])
    assert tok.name == hf_tok[form] and tok.vocab_size == 300 and tok.eod == 0
    ids = tok.encode(TEXT)
    assert tok.eod not in ids and tok.decode(ids) == TEXT
    assert len(tok.encode(UNSEEN)) == 3  # byte-level BPE: one id per byte of it
    ids2 = [*ids, tok.eod, *tok.encode(" fox")]
    stream = tok.stream()
    pieces = [stream.add(i) for i in ids2]
    assert "".join(pieces) + stream.flush() == tok.decode(ids2) == TEXT + "\n fox"
    assert "\ufffd" not in "".join(pieces)  # the unseen character waited for its 3 bytes
    # the two forms are the same tokenizer
    assert T.load_tokenizer(hf_tok["dir" if form == "json" else "json"]).encode(TEXT) == ids


def test_token_dtype() -> None:
    from hla_sp.launch.data.make_dataset import token_dtype

    assert [token_dtype(v) for v in (200, 256, 257, 65536, 65537, 152064)] == [
        np.uint8, np.uint8, np.uint16, np.uint16, np.int32, np.int32]


# --- make-dataset, train, generate ------------------------------------------------------


def _doc_make_dataset() -> list[str]:
    """docs/launch.md's make-dataset command with --tokenizer, as written."""
    for line in (ROOT / "docs" / "launch.md").read_text().splitlines():
        line = line.strip().strip("`")
        if line.startswith("hla-sp make-dataset ") and "--tokenizer" in line:
            return shlex.split(line)
    raise AssertionError("docs/launch.md: no make-dataset --tokenizer command")


@pytest.fixture(scope="module")
def data(hf_tok: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("data")
    (d / "docs").mkdir()
    for i, doc in enumerate(CORPUS):
        (d / "docs" / f"{i}.txt").write_text((doc + ". ") * 40)
    argv = _doc_make_dataset()
    subs = {"docs/": str(d / "docs"), "data/corpus": str(d / "corpus"),
            "tokenizer/": hf_tok["dir"]}
    argv = [subs.get(a, a) for a in argv]
    assert hf_tok["dir"] in argv and str(d / "corpus") in argv, argv
    p = _run(*argv[1:])
    assert p.returncode == 0, p.stderr
    assert f"tokenizer {hf_tok['dir']}, vocab 300, EOD = 0" in p.stdout, p.stdout
    return str(d / "corpus")


def test_make_dataset_writes_the_tokenizers_ids(data: str, hf_tok: dict[str, str]) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    side = json.loads(Path(data + ".json").read_text())
    assert (side["tokenizer"], side["vocab_size"], side["eod"], side["dtype"]) == (
        hf_tok["dir"], 300, 0, "uint16")
    tok = T.load_tokenizer(hf_tok["dir"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = IndexedDataset(data)  # Megatron's own reader (pretrain_gpt's)
    assert len(ds) == len(CORPUS) == side["documents"]
    for i, doc in enumerate(CORPUS):
        want = [*tok.encode((doc + ". ") * 40), 0]
        assert ds[i].dtype == np.uint16 and ds[i].tolist() == want
    assert sum(len(ds[i]) for i in range(len(ds))) == side["tokens"]


@pytest.fixture(scope="module")
def ckpt(data: str, hf_tok: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-iteration run on the tokenized data, validated at the end."""
    out = tmp_path_factory.mktemp("run") / "ckpt"
    p = _run("train", "--nproc-per-node", "1", *TINY, "--train-iters", "4", "--data-path",
             data, "--tokenizer", hf_tok["dir"], "--eval-interval", "4", "--eval-iters", "1",
             "--save", str(out))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out


def test_checkpoint_records_the_tokenizer_and_losses(ckpt: Path, hf_tok: dict[str, str]) -> None:
    from hla_sp.launch.checkpoint.run_config import saved_losses

    saved = json.loads((ckpt / "iter_0000004" / "config.json").read_text())
    # --vocab-size was not given: the tokenizer's vocabulary
    assert saved["model"]["tokenizer"] == hf_tok["dir"] and saved["model"]["vocab_size"] == 300
    losses = saved_losses(str(ckpt), 4)
    assert set(losses) == {"loss", "val_loss"}
    assert all(np.isfinite(v) and 0 < v < 10 for v in losses.values()), losses


def test_generate_uses_the_runs_tokenizer(ckpt: Path, hf_tok: dict[str, str],
                                          capsys: pytest.CaptureFixture) -> None:
    from hla_sp.launch.checkpoint.run_config import saved_losses
    from hla_sp.launch.cli import commands as cli
    from hla_sp.launch.export import generate as gen

    prompt = "the brown fox"
    assert cli.main(["generate", "--load", str(ckpt), "--prompt", prompt, "--temperature",
                     "0", "--max-new-tokens", "12", "--no-stop-at-eod"]) == 0
    out, err = capsys.readouterr()
    first = err.splitlines()[0]
    val = saved_losses(str(ckpt), 4)["val_loss"]
    assert first == (f"hla-sp generate: {ckpt} iteration 4 (validation loss {val:.4g} nats "
                     f"per token)"), first
    # the same greedy ids in this process, decoded by the run's tokenizer
    tok = T.load_tokenizer(hf_tok["dir"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with gen.single_process():
            model, cfg = gen.load_model(str(ckpt))
            g = gen.generate(model, tok.encode(prompt), 12, stop_at_eod=False, eod=tok.eod,
                             vocab=cfg.model.vocab_size)
    assert len(g.tokens) == 12 and max(g.tokens) < 300
    assert out == prompt + tok.decode(g.tokens) + "\n"


# --- one-line errors ---------------------------------------------------------------------


def _refused(argv: list[str], capsys: pytest.CaptureFixture,
             monkeypatch: pytest.MonkeyPatch) -> str:
    """``hla-sp ARGV`` in this process: exit 2 and one line on stderr, nothing started."""
    from hla_sp.launch.cli import commands as cli

    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail("torchrun was started"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err.startswith(f"hla-sp {argv[0]}: error: "), err
    return err


def test_errors_name_the_flag(data: str, hf_tok: dict[str, str], tmp_path: Path,
                              capsys: pytest.CaptureFixture,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    missing = str(tmp_path / "no-such-tokenizer")
    err = _refused(["make-dataset", "--input", str(ROOT / "README.md"), "--output-prefix",
                    str(tmp_path / "x"), "--tokenizer", missing], capsys, monkeypatch)
    assert f"--tokenizer {missing}: no such file or directory" in err, err
    assert not list(tmp_path.glob("x*"))  # refused before anything was written
    # data of one tokenizer, trained as bytes (no --tokenizer): refused before torchrun
    err = _refused(["train", *TINY, "--data-path", data], capsys, monkeypatch)
    assert re.search(rf"--tokenizer: expected {re.escape(hf_tok['dir'])} \(vocabulary 300, "
                     rf"EOD 0\), which made --data-path {re.escape(data)} .*got bytes \(the "
                     rf"default\)", err), err
    err = _refused(["train", *TINY, "--data-path", data, "--tokenizer", hf_tok["dir"],
                    "--vocab-size", "257"], capsys, monkeypatch)
    assert "--vocab-size: expected at least 300 (the vocabulary of --tokenizer " in err, err
    err = _refused(["train", *TINY, "--tokenizer", hf_tok["dir"]], capsys, monkeypatch)
    assert "the built-in text is byte-level" in err, err


def test_tokenizer_errors_in_one_line(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    with pytest.raises(T.TokenizerError, match=r"^--tokenizer /nowhere/tok: no such file"):
        T.load_tokenizer("/nowhere/tok")
    # a directory that is not a tokenizer
    (tmp_path / "empty").mkdir()
    with pytest.raises(T.TokenizerError, match=r"^--tokenizer .*empty: cannot load it"):
        T.load_tokenizer(str(tmp_path / "empty"))
    # no end of sequence token: nothing to end a document with
    wl = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=wl).save_pretrained(tmp_path / "noeos")
    with pytest.raises(T.TokenizerError, match="expected a tokenizer with an end of sequence"):
        T.load_tokenizer(str(tmp_path / "noeos"))
    wl.save(str(tmp_path / "bare.json"))
    with pytest.raises(T.TokenizerError, match="expected exactly one special token in it, "
                                               "got 0"):
        T.load_tokenizer(str(tmp_path / "bare.json"))

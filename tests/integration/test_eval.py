"""``hla-sp eval``: long-context figures that do not depend on the context-parallel size.

A tiny model from a real ``hla-sp train`` run is evaluated by the commands of
docs/eval.md as written (lengths shrunk to 256 and 512), at two ranks under torchrun
with gloo, and again at one rank; every figure must agree. Then the JSON and the PNG,
the pieces (lengths, buckets, passkey prompts, the key's scoring), and the one-line
errors, from the launcher and from the workers.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_flags

pytest.importorskip("megatron.core")

from hla_sp.launch.distributed.local import worker_env as _env
from hla_sp.launch.eval import tasks

ROOT = Path(__file__).resolve().parents[2]
HLA_SP = os.path.join(os.path.dirname(sys.executable), "hla-sp")
TINY = tiny_flags(2, 64, "--train-iters", "2", "--position-embedding-type", "none")
# what the documented commands get in place of their million-token lengths
SMALL = {"--lengths": "256,512", "--samples": "2"}
# Tolerance: the per-token losses of CP=2 and CP=1 differ only by the rounding of the
# model's fp32 sums (the HLA scan's state passed between ranks, added in another order),
# about 1e-7 of a loss; the bucket means are float64 sums of them. 2e-9 relative
# measured; a lost or misplaced chunk moves a bucket in its third digit.
REL = 1e-5


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of a real two-iteration ``hla-sp train`` run (positions none)."""
    ckpt = tmp_path_factory.mktemp("eval") / "ckpt"
    p = subprocess.run([HLA_SP, "train", *TINY, "--save", str(ckpt)], capture_output=True,
                       text=True, env=_env(None), timeout=600)
    assert p.returncode == 0, p.stderr
    return ckpt


def _doc_commands() -> list[list[str]]:
    """The ``hla-sp eval`` lines of docs/eval.md (continuations joined)."""
    text = (ROOT / "docs" / "eval.md").read_text()
    section = text[text.index("## Long context (hla-sp eval)"):]
    out = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("hla-sp eval"):
                out.append(shlex.split(line))
    return out


def _as_here(argv: list[str], ckpt: Path, out: Path) -> list[str]:
    """A documented command with the test's checkpoint, output and small lengths."""
    argv = list(argv)
    for flag, value in {"--load": str(ckpt), "--output": str(out), **SMALL}.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    if "ppl-by-position" in argv:
        argv += ["--first-bucket", "64"]  # four buckets in 512 positions
    return argv


def _one_rank(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The same evaluation in this process, as a world of one (CP=1)."""
    from hla_sp.launch.distributed.process_groups import free_port
    from hla_sp.launch.eval import run as eval_run
    from hla_sp.launch.eval.command import build_parser, output_paths

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    flags = argv[2:]
    for flag in ("--nproc-per-node", "--context-parallel-size"):
        i = flags.index(flag)
        flags[i + 1] = "1"
    assert eval_run.main(flags) == 0
    return json.loads(Path(output_paths(build_parser().parse_args(flags))[0]).read_text())


@pytest.fixture(scope="module")
def documented(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Each documented command run as written, through the console script (2 ranks)."""
    runs = []
    for argv in _doc_commands():
        out = tmp_path_factory.mktemp("doc")
        here = _as_here(argv, trained, out)
        p = subprocess.run([HLA_SP, *here[1:]], capture_output=True, text=True,
                           env=_env(None), timeout=600, cwd=out)
        assert p.returncode == 0, (here, p.stderr[-3000:])
        task = here[here.index("--task") + 1]
        runs.append({"argv": here, "stdout": p.stdout, "out": out, "task": task,
                     "json": json.loads((out / f"{task}.json").read_text())})
    return runs


def test_docs_name_both_tasks_at_two_ranks(documented: list[dict]) -> None:
    assert sorted(r["task"] for r in documented) == ["passkey", "ppl-by-position"]
    for r in documented:
        assert r["json"]["context_parallel_size"] == 2, r["argv"]


def test_two_ranks_give_one_rank_figures(documented: list[dict], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    for run in documented:
        two = run["json"]
        argv = list(run["argv"])
        argv[argv.index("--output") + 1] = str(tmp_path / run["task"])
        one = _one_rank(argv, monkeypatch)
        assert one["context_parallel_size"] == 1 and two["context_parallel_size"] == 2
        assert [r["length"] for r in one["results"]] == [256, 512]
        for a, b in zip(one["results"], two["results"], strict=True):
            if run["task"] == "ppl-by-position":
                assert [x["tokens"] for x in a["buckets"]] == [x["tokens"] for x in b["buckets"]]
                for x, y in zip(a["buckets"], b["buckets"]):
                    assert math.isclose(x["loss_nats"], y["loss_nats"], rel_tol=REL), (x, y)
                assert math.isclose(a["loss_nats"], b["loss_nats"], rel_tol=REL)
            else:
                for x, y in zip(a["depths"], b["depths"], strict=True):
                    assert x["accuracy"] == y["accuracy"]
                    for s, t in zip(x["samples"], y["samples"], strict=True):
                        assert (s["key"], s["needle_at"], s["retrieved"]) == (
                            t["key"], t["needle_at"], t["retrieved"])
                        assert math.isclose(s["digit_logprob"], t["digit_logprob"],
                                            rel_tol=REL)


def test_json_and_png(documented: list[dict], trained: Path) -> None:
    import matplotlib.image

    for run in documented:
        rec, argv = run["json"], run["argv"]
        assert rec["command"] == shlex.join(["hla-sp", *argv[1:]])
        assert rec["iteration"] == 2 and rec["load"] == str(trained)
        assert rec["checkpoint"] == str(trained / "iter_0000002")
        assert rec["lengths"] == [256, 512] and rec["samples"] == 2
        assert rec["timing"]["load_s"] > 0 and rec["timing"]["total_s"] > 0
        for r in rec["results"]:
            assert r["seconds"] > 0 and r["peak_mem_bytes"] > 0
            assert r["seconds_per_1k_tokens"] == pytest.approx(r["seconds"] / r["tokens"] * 1e3)
            if rec["task"] == "ppl-by-position":
                # every position once per window, in buckets [0,64) [64,128) [128,256) ...
                assert [(x["lo"], x["hi"]) for x in r["buckets"]] == tasks.buckets(
                    r["length"], 64)
                assert sum(x["tokens"] for x in r["buckets"]) == 2 * r["length"]
                for x in r["buckets"]:
                    assert x["bits_per_token"] == pytest.approx(x["loss_nats"] / math.log(2))
                    assert 0 < x["loss_nats"] < 2 * math.log(257)
            else:
                assert r["tokens"] == r["length"] * 2 * 5
                assert [d["depth"] for d in r["depths"]] == [0, 0.25, 0.5, 0.75, 1]
                assert all(d["digit_logprob"] < 0 for d in r["depths"])
        # the shared buckets of the two lengths cover the same text: equal figures
        if rec["task"] == "ppl-by-position":
            a, b = rec["results"]
            for x, y in zip(a["buckets"], b["buckets"][:3]):
                assert x["loss_nats"] == pytest.approx(y["loss_nats"], rel=REL)
        png = run["out"] / f"{rec['task']}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        h, w = matplotlib.image.imread(png).shape[:2]
        assert h > 200 and w > 300
        assert f"eval: {run['out'] / rec['task']}.json" in run["stdout"]
        assert run["stdout"].count("length ") >= 2


# ------------------------------------------------------------------------ the pieces


def test_lengths_and_buckets() -> None:
    assert tasks.parse_lengths("4k,16k,64k,256k,1M") == [4096, 16384, 65536, 262144, 1 << 20]
    assert tasks.parse_lengths("300") == [300]
    assert [tasks.short(n) for n in (4096, 1 << 20, 1000)] == ["4k", "1M", "1000"]
    for length, first in ((3000, 1024), (512, 64), (64, 64), (1000, 1)):
        edges = tasks.buckets(length, first)
        assert edges[0][0] == 0 and edges[-1][1] == length
        assert all(a[1] == b[0] for a, b in itertools.pairwise(edges))
        pos = torch.arange(length)
        which = tasks.bucket_of(pos, first)
        for i, (lo, hi) in enumerate(edges):  # a brute-force reference
            assert torch.equal(pos[which == i], torch.arange(lo, hi)), (length, first, i)


def test_passkey_prompts() -> None:
    from hla_sp.launch.data.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    seen = []
    for d, depth in enumerate((0.0, 0.5, 1.0)):
        pk = tasks.passkey(tok, 512, depth, 0, d, 0)
        text = tok.decode(pk.tokens[1:].tolist())
        assert len(pk.tokens) == 513 and pk.tokens[0] == tok.eod
        assert len(pk.key) == 5 and pk.answer_tokens == 5
        assert text.endswith("What is the pass key? The pass key is " + pk.key)
        needle = tasks.NEEDLE.format(key=pk.key)
        assert tok.decode(pk.tokens[pk.needle_at:pk.needle_at + len(needle)].tolist()) == needle
        seen.append(pk.needle_at)
    assert seen[0] == 1 and seen[0] < seen[1] < seen[2]
    assert seen[2] == 513 - len(tok.encode(tasks.QUESTION)) - 5 - len(needle)
    again = tasks.passkey(tok, 512, 0.5, 0, 1, 0)
    assert again.key == tasks.passkey(tok, 512, 0.5, 0, 1, 0).key
    assert (again.tokens == tasks.passkey(tok, 512, 0.5, 0, 1, 0).tokens).all()
    assert len({tasks.passkey(tok, 512, 0.5, 0, 1, i).key for i in range(8)}) > 1


def test_data_path_windows(tmp_path: Path, capsys: Any) -> None:
    """--data-path: window i at every length starts at token i x (longest + 1) of the
    prefixes' stream, documents joined by their EOD; too little data is one line."""
    from hla_sp.launch.config.train_config import parse_args
    from hla_sp.launch.data.indexed_dataset import EOD, IndexedTokens
    from hla_sp.launch.data.make_dataset import main as make
    from hla_sp.launch.errors import DatasetError

    for name, word in (("a", "abc "), ("b", "xyz ")):
        (tmp_path / f"{name}.txt").write_text(word * 500)
    prefix = str(tmp_path / "d")
    assert make(["--input", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"),
                 "--output-prefix", prefix]) == 0
    capsys.readouterr()
    stream = IndexedTokens([prefix]).read(0, 4002)  # two documents of 2000 bytes + EOD
    assert stream[2000] == EOD and stream[4001] == EOD
    cfg = parse_args(TINY)
    w = tasks.text_windows(cfg, [prefix], 3, 512)
    assert (w.start, w.stride) == (0, 513) and w.source == f"--data-path {prefix}"
    for i in range(3):
        for length in (256, 512):
            assert (w.window(i, length) == stream[i * 513 : i * 513 + length + 1]).all()
    with pytest.raises(DatasetError, match=r"^--samples 4 x \(longest --lengths 1024 \+ 1\) "
                       r"= 4,100 tokens: the --data-path .* holds 4,002 past token 0; "):
        tasks.text_windows(cfg, [prefix], 4, 1024)


def test_key_scoring_picks_global_positions() -> None:
    """The key's labels are found by global position, whatever order a rank holds them
    in; a hit needs the argmax, the log-prob is log_softmax's."""
    from hla_sp.launch.eval.run import key_stats

    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 14, 15, 2, 3, 12, 13])  # zigzag-like order, length 16
    labels = torch.randint(0, 20, (8,), generator=g)
    logits = torch.randn(8, 20, generator=g)
    logits[2, labels[2]] = 50.0  # positions 14, 12 predicted right; 15 and 13 not
    logits[6, labels[6]] = 50.0
    for i in (3, 7):
        logits[i, (labels[i] + 1) % 20] = 50.0
    lp, hits, n = key_stats(logits, labels, positions, first=12).tolist()
    rows = [2, 3, 6, 7]
    want = torch.log_softmax(logits[rows].double(), -1)[range(4), labels[rows]].sum()
    assert (hits, n) == (2, 4) and lp == pytest.approx(float(want), rel=1e-12)


# ------------------------------------------------------------------------ the errors


def _learned(trained: Path, root: Path) -> Path:
    """The trained checkpoint, its config saying learned positions of 64 (refused before
    its weights are read, so they need not match)."""
    return _edited(trained, root, position_embedding_type="learned_absolute")


def _edited(trained: Path, root: Path, **change: Any) -> Path:
    """A copy of the checkpoint with its config.json edited and the manifest's digest of
    that file updated (else the manifest check refuses it first)."""
    ckpt = root / "c"
    shutil.copytree(trained, ckpt)
    d = ckpt / "iter_0000002"
    from hla_sp.launch.config.train_config import flat_config

    cfg = flat_config(json.loads((d / "config.json").read_text()))  # flat: still read
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    man = json.loads((d / "manifest.json").read_text())
    raw = (d / "config.json").read_bytes()
    man["files"]["config.json"] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (d / "manifest.json").write_text(json.dumps(man))
    return ckpt


@pytest.mark.parametrize("case,flags,match", [
    ("learned", ["--lengths", "64,256,512"],
     r"--lengths: the checkpoint's learned_absolute position table ends at 64 tokens .*"
     r"got 256, 512; use lengths <= 64"),
    ("zigzag", ["--lengths", "256,250", "--nproc-per-node", "2"],
     r"--lengths: expected lengths divisible by 2 x --context-parallel-size = 4 .*got 250; "
     r"use e.g. 248 or 252"),
    ("cp", ["--lengths", "256", "--context-parallel-size", "2"],
     r"--context-parallel-size: expected --nproc-per-node \(1; .*got 2"),
    ("unit", ["--lengths", "4x"], r"--lengths: expected comma-separated token counts .*'4x'"),
    ("data", ["--lengths", "1M", "--samples", "40"],
     r"--samples 40 x \(longest --lengths 1048576 \+ 1\) = 41,943,080 tokens: the built-in "
     r"held-out text .* holds [\d,]+ past token"),
    ("short", ["--task", "passkey", "--lengths", "64"],
     r"--lengths: expected at least 102 tokens for the passkey prompt, got 64"),
    ("depth", ["--task", "passkey", "--lengths", "256", "--depths", "0,1.5"],
     r"--depths: expected comma-separated fractions in \[0, 1\] .*'1.5'"),
    ("missing", ["--lengths", "256"], r"--load .*nowhere: no such directory"),
])  # fmt: skip
def test_errors_in_one_line_before_any_work(trained: Path, tmp_path: Path, capsys: Any,
                                            case: str, flags: list[str], match: str) -> None:
    from hla_sp.launch.cli.commands import main

    load = (_learned(trained, tmp_path) if case == "learned"
            else tmp_path / "nowhere" if case == "missing" else trained)
    base = ["eval", "--load", str(load), "--task", "ppl-by-position",
            "--output", str(tmp_path / "out")]
    assert main([*base, *flags]) == 2
    out, err = capsys.readouterr()
    err = err.strip()
    assert out == "" and "\n" not in err and err.startswith("hla-sp eval: error: "), err
    assert re.search(match, err), err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_worker_error_is_one_line(trained: Path, tmp_path: Path) -> None:
    """A checkpoint whose weights do not fit its config passes the launcher's checks and
    fails in every worker: printed once, in one line, without torchrun's summary."""
    ckpt = _edited(trained, tmp_path, hidden_size=48)
    p = subprocess.run([HLA_SP, "eval", "--load", str(ckpt), "--task", "passkey",
                        "--lengths", "256", "--nproc-per-node", "2",
                        "--output", str(tmp_path / "out")],
                       capture_output=True, text=True, env=_env(None), timeout=600)
    err = p.stderr.strip()
    assert p.returncode == 2, p.stderr
    assert "\n" not in err and err.startswith("hla-sp eval: error: "), err
    assert "is (2, 32) in the checkpoint, this model's is (2, 48)" in err


def test_unexpected_worker_error_is_one_traceback_and_one_line(trained: Path,
                                                               tmp_path: Path) -> None:
    """Rank 1 raises an error of no known kind at the first length: one traceback, one
    summary line, no torchrun dump (issue 52, item 3)."""
    p = subprocess.run([HLA_SP, "eval", "--load", str(trained), "--task", "ppl-by-position",
                        "--lengths", "128", "--samples", "1", "--nproc-per-node", "2",
                        "--output", str(tmp_path / "out")],
                       capture_output=True, text=True, env=_env({"HLA_SP_FAULT": "1:1:raise"}),
                       timeout=600)
    err = p.stderr
    assert p.returncode == 1, err
    assert err.count("Traceback (most recent call last)") == 1, err
    assert "ChildFailedError" not in err and "[hla-sp] rank" not in err, err
    assert err.strip().splitlines()[-1].startswith(
        "hla-sp eval: error: rank 1/2 stopped by RuntimeError: HLA_SP_FAULT: injected error "
        "on rank 1 at iteration 1 (during evaluation)"), err


def test_help(capsys: Any) -> None:
    from hla_sp.launch.cli.commands import main

    with pytest.raises(SystemExit) as e:
        main(["eval", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: hla-sp eval")
    for flag in ("--load", "--task", "--lengths", "--samples", "--depths", "--data-path",
                 "--nproc-per-node", "--context-parallel-size", "--output", "--first-bucket"):
        assert flag in text
    main([])
    assert "hla-sp eval --load DIR" in capsys.readouterr().out  # the console's usage

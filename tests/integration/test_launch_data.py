"""Data: the text-to-dataset tool round-trips; samples are stateless; recall crosses ranks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hla_sp.launch.data.datasets import (
    EOD,
    ArrayTokens,
    IndexedTokens,
    RecallSamples,
    TextSamples,
    builtin_text_tokens,
    recall_positions,
)
from hla_sp.launch.data.make_dataset import decode

TEXTS = {
    "a.txt": "first document\nwith two lines\n",
    "sub/b.md": "zweites Dokument: äöü ß — ünïcödé ✓\n",
    "sub/c.txt": "",  # an empty file is still a (zero-length) document
    "z.txt": "x" * 1000,
}


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    for name, text in TEXTS.items():
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_text(text, encoding="utf-8")
    return tmp_path


def test_make_dataset_round_trips_through_megatron(corpus: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = corpus / "out" / "ds"
    p = subprocess.run(
        [sys.executable, "-m", "hla_sp.launch.make_dataset", "--input", str(corpus / "in"),
         "--output-prefix", str(prefix)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert not list((corpus / "out").glob("*.tmp*"))  # only the finished pair remains
    ds = IndexedDataset(str(prefix))
    names = sorted(TEXTS)  # the tool walks directories in sorted order
    assert len(ds) == len(names)
    for i, name in enumerate(names):
        tokens = ds[i]
        assert tokens[-1] == EOD
        assert decode(tokens).decode("utf-8") == TEXTS[name]
    # the trainer's reader sees the same stream, across document boundaries
    stream = IndexedTokens([str(prefix)])
    whole = np.concatenate([ds[i] for i in range(len(ds))])
    assert len(stream) == len(whole)
    assert np.array_equal(stream.read(5, len(whole) - 7), whole[5:-2])
    assert stream.max_token() == EOD


def test_make_dataset_missing_input_is_a_clear_error(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "hla_sp.launch.make_dataset", "--input", str(tmp_path / "nope"),
         "--output-prefix", str(tmp_path / "x")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2 and "no such file or directory" in p.stderr


def test_samples_depend_only_on_index() -> None:
    tokens = builtin_text_tokens(0, budget=200_000)
    assert tokens.max() == EOD and tokens.min() >= 0
    a, b = (
        TextSamples(ArrayTokens(tokens), 64, seed=3),
        TextSamples(ArrayTokens(tokens), 64, seed=3),
    )
    order = [5, 1, a.num_windows + 2, 5]  # out of order and across an epoch: no hidden state
    for i in order:
        assert torch.equal(a[i].tokens, b[i].tokens)
    s = a[7]
    assert torch.equal(s.tokens[1:], s.labels[:-1])  # labels are the next tokens
    assert not torch.equal(a[0].tokens, TextSamples(ArrayTokens(tokens), 64, seed=4)[0].tokens)


@pytest.mark.parametrize("cp", [2, 4])
def test_recall_pairs_and_queries_live_on_different_cp_ranks(cp: int) -> None:
    T, n = 256, 8
    s = RecallSamples(T, n, seed=0)[3]
    assert int(s.loss_mask.sum()) == n
    _, q0 = recall_positions(T, n)
    assert q0 == T // 2
    # queried keys equal the stored keys, and each label is the value stored with its key
    stored = dict(zip(s.tokens[0 : 2 * n : 2].tolist(), s.tokens[1 : 2 * n : 2].tolist()))
    for pos in torch.nonzero(s.loss_mask).flatten().tolist():
        assert stored[int(s.tokens[pos])] == int(s.labels[pos])
    # Megatron's zigzag: 2 x CP equal chunks, rank r holds chunks r and 2 x CP - 1 - r
    chunk = T // (2 * cp)

    def owner(p: int) -> int:
        c = p // chunk
        return c if c < cp else 2 * cp - 1 - c

    assert {owner(p) for p in range(2 * n)} == {0}
    query_ranks = {owner(p) for p in torch.nonzero(s.loss_mask).flatten().tolist()}
    assert 0 not in query_ranks

"""Data at corpus scale: opening is flat in the number of sequences, the whole index is
validated in streamed blocks, a crafted index is refused by name before it costs
memory, the .bin is never scanned, and Megatron's weighted --data-path blends."""

from __future__ import annotations

import os
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from hla_sp.launch.checks import validate
from hla_sp.launch.config.train_config import ConfigError, parse_args
from hla_sp.launch.data import indexed_dataset
from hla_sp.launch.data.datasets import (
    BlendedSamples,
    DatasetError,
    IndexedTokens,
    build_samples,
    infer_vocab_size,
    parse_data_path,
)
from hla_sp.launch.data.indexed_dataset import check_indexed_dataset

HEADER = 34


def write_synthetic(
    output_prefix: str, sequences: int, tokens_per_sequence: int, block: int = 1 << 22
) -> dict[str, int]:
    """A synthetic Megatron dataset of ``sequences`` one-sequence documents of
    ``tokens_per_sequence`` uint16 tokens each, for scale tests: the index is written in
    blocks (memory stays flat at 10^8 sequences, a 2 GB .idx) and the .bin is a sparse
    file of zeros of the right size, so it takes no disk until read."""
    item = 2
    n_tokens = sequences * tokens_per_sequence
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    with open(output_prefix + ".bin", "wb") as f:
        f.truncate(n_tokens * item)
    with open(output_prefix + ".idx", "wb") as f:
        # the layout megatron-core's _IndexWriter writes: header, lengths, pointers, documents
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8))
        f.write(struct.pack("<QQ", sequences, sequences + 1))
        for lo in range(0, sequences, block):
            k = min(block, sequences - lo)
            f.write(np.full(k, tokens_per_sequence, dtype=np.int32).tobytes())
        for lo in range(0, sequences, block):
            k = min(block, sequences - lo)
            ptr = np.arange(lo, lo + k, dtype=np.int64) * (tokens_per_sequence * item)
            f.write(ptr.tobytes())
        for lo in range(0, sequences + 1, block):
            k = min(block, sequences + 1 - lo)
            f.write(np.arange(lo, lo + k, dtype=np.int64).tobytes())
    return {"sequences": sequences, "tokens": n_tokens,
            "idx_bytes": os.path.getsize(output_prefix + ".idx")}


def _constant_dataset(prefix: Path, token: int, docs: int = 50, length: int = 40) -> str:
    """A dataset whose every token is ``token`` (so a sample says where it came from)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    b = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    for _ in range(docs):
        b.add_item(torch.full((length,), token, dtype=torch.int64))
        b.end_document()
    b.finalize(str(prefix) + ".idx")
    return str(prefix)


def _patch(path: str, offset: int, fmt: str, value: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, value))


@pytest.fixture()
def synth(tmp_path: Path) -> str:
    """1000 one-sequence documents of 10 tokens (lengths, pointers, documents as written
    by megatron-core's builder)."""
    prefix = str(tmp_path / "s")
    write_synthetic(prefix, 1000, 10)
    return prefix


def test_synthetic_index_reads_as_megatron_writes_it(synth: str) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(synth)
    assert len(ds) == 1000 and int(ds.sequence_lengths.sum()) == 10_000
    info = check_indexed_dataset(synth)
    assert (info.sequences, info.documents, info.tokens) == (1000, 1001, 10_000)


def test_open_is_flat_in_the_number_of_sequences(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """10^6 sequences (a 20 MB index): the open and the whole-index check allocate a few
    blocks, not per-sequence arrays or objects; the stream's length is O(1) state."""
    prefix = str(tmp_path / "m")
    write_synthetic(prefix, 1_000_000, 3)
    monkeypatch.setattr(indexed_dataset, "VALIDATE_BLOCK", 1 << 14)
    indexed_dataset._CHECKED.clear()
    import megatron.core.datasets.indexed_dataset  # noqa: F401  (imports are not the open)

    tracemalloc.start()
    try:
        stream = IndexedTokens([prefix])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(stream) == 3_000_000
    assert peak < 2 << 20, f"opening allocated {peak} bytes for a 20 MB index"
    # nothing sized by the sequence count is kept
    for v in vars(stream).values():
        assert not (isinstance(v, (list, tuple, np.ndarray)) and len(v) >= 1000), v
    assert stream.read(2_999_990, 10).tolist() == [0] * 10


def _valid_small(tmp_path: Path) -> str:
    prefix = str(tmp_path / "c")
    write_synthetic(prefix, 8, 4)  # 8 sequences of 4 uint16 tokens
    indexed_dataset._CHECKED.clear()
    return prefix


CRAFTED = {
    # name: (field offset from the header, struct format, value, message)
    "negative-length": (HEADER + 4 * 3, "<i", -5, "sequence 3 has length -5"),
    "huge-length": (HEADER + 4 * 3, "<i", 2**31 - 1, "sequence 3 (pointer 24, 2147483647 "
                    "tokens of 2 bytes) lies outside"),
    "pointer-past-end": (HEADER + 32 + 8 * 5, "<q", 10**12, "sequence 5 (pointer "
                         "1000000000000"),
    "negative-pointer": (HEADER + 32 + 8 * 2, "<q", -8, "sequence 2 (pointer -8"),
    "gap": (HEADER + 32 + 8 * 4, "<q", 34, "sequence 4 starts at byte 34, expected 32"),
    "documents-decrease": (HEADER + 96 + 8 * 3, "<q", 1, "document index 3 is 1"),
    "documents-past-end": (HEADER + 96 + 8 * 8, "<q", 9, "document index 8 is 9"),
    "version": (9, "<Q", 7, "index version 7, expected 1"),
    "dtype": (17, "<B", 99, "unknown token dtype code 99"),
    "sequence-count": (18, "<Q", 2**40, "truncated: 1099511627776 sequences"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_index_refused_by_name(tmp_path: Path, case: str) -> None:
    prefix = _valid_small(tmp_path)
    check_indexed_dataset(prefix)
    indexed_dataset._CHECKED.clear()
    offset, fmt, value, needle = CRAFTED[case]
    _patch(prefix + ".idx", offset, fmt, value)
    with pytest.raises(DatasetError) as e:
        check_indexed_dataset(prefix)
    assert needle in str(e.value) and prefix + ".idx" in str(e.value), str(e.value)
    # the trainer refuses it before any process group, naming the flag
    with pytest.raises(ConfigError) as e2:
        validate(parse_args(["--data-path", prefix]), 1)
    assert str(e2.value).startswith(f"--data-path {prefix}: ") and needle in str(e2.value)


def test_huge_lengths_in_the_middle_cost_no_memory(tmp_path: Path) -> None:
    """The issue's crafted index: small, huge lengths mid-file; refused in the check with
    no allocation the lengths imply (before: 1.6 GB of RSS, then a numpy error)."""
    prefix = _valid_small(tmp_path)
    for i in (2, 3, 4):
        _patch(prefix + ".idx", HEADER + 4 * i, "<i", 2**31 - 1)
    tracemalloc.start()
    try:
        with pytest.raises(DatasetError, match=r"sequence 2 .* lies outside"):
            check_indexed_dataset(prefix)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_last_document_must_close_the_index(tmp_path: Path) -> None:
    prefix = _valid_small(tmp_path)
    _patch(prefix + ".idx", HEADER + 96 + 8 * 8, "<q", 7)
    with pytest.raises(DatasetError, match="last document index is 7, expected the sequence"):
        check_indexed_dataset(prefix)


def test_the_bin_is_never_scanned(tmp_path: Path) -> None:
    """Vocabulary from the flag (as Megatron's tokenizer gives it), not from the data: an
    id outside it is refused when its sample is read, naming the file, the position and
    --vocab-size; samples elsewhere still read."""
    prefix = _constant_dataset(tmp_path / "v", token=7, docs=20, length=50)
    with open(prefix + ".bin", "r+b") as f:
        f.seek(2 * 900)
        f.write(struct.pack("<H", 50000))
    assert infer_vocab_size("text", [prefix]) == indexed_dataset.BYTE_VOCAB  # no scan
    stream = IndexedTokens([prefix], vocab_size=257)
    assert stream.read(0, 100).tolist() == [7] * 100
    with pytest.raises(DatasetError) as e:
        stream.read(850, 100)
    msg = str(e.value)
    assert f"{prefix}.bin: token 900 is 50000" in msg and "--vocab-size" in msg, msg
    assert IndexedTokens([prefix], vocab_size=50001).read(900, 1).tolist() == [50000]


def test_weighted_data_path_blends_like_megatron(tmp_path: Path) -> None:
    a = _constant_dataset(tmp_path / "a", 1)
    b = _constant_dataset(tmp_path / "b", 2)
    assert parse_data_path(["0.3", a, "0.7", b]) == ([a, b], [0.3, 0.7])
    assert parse_data_path(["30", a, "70", b])[1] == pytest.approx([0.3, 0.7])
    assert parse_data_path([a, b]) == ([a, b], None)
    validate(parse_args(["--data-path", "0.3", a, "0.7", b, "--seq-length", "16"]), 1)
    samples = build_samples("text", ["0.3", a, "0.7", b], 16, 5, 8)
    assert isinstance(samples, BlendedSamples)
    firsts = [int(samples[i].tokens[0]) for i in range(1000)]
    assert {firsts.count(1), firsts.count(2)} == {300, 700}
    assert firsts.count(1) == 300
    # each sample is pure: one source per sample, never a mix
    assert all(set(samples[i].tokens.tolist()) in ({1}, {2}) for i in range(50))
    # prefix-stable: growing the indices does not change earlier samples
    fresh = build_samples("text", ["0.3", a, "0.7", b], 16, 5, 8)
    assert [int(fresh[i].tokens[0]) for i in (5000, 3, 999)] == [
        int(samples[5000].tokens[0]), firsts[3], firsts[999]]


@pytest.mark.parametrize("bad", [["-1", "A", "2", "B"], ["0", "A", "0", "B"],
                                 ["nan", "A", "1", "B"]])
def test_bad_weights_refused(tmp_path: Path, bad: list[str]) -> None:
    a = _constant_dataset(tmp_path / "a", 1)
    argv = [x if x not in ("A", "B") else a for x in bad]
    with pytest.raises(ConfigError, match="expected weights >= 0, not all 0"):
        validate(parse_args(["--data-path", *argv]), 1)


def test_weighted_data_path_trains_one_iteration(tmp_path: Path) -> None:
    from hla_sp.launch.train.main import run

    a = _constant_dataset(tmp_path / "a", 1)
    b = _constant_dataset(tmp_path / "b", 2)
    recs = run(parse_args([
        "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--train-iters", "1", "--data-path", "0.5", a, "0.5", b,
    ]), exit_on_error=False)  # fmt: skip
    assert len(recs) == 1 and np.isfinite(recs[0]["loss"])

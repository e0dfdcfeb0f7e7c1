"""Training data: Megatron indexed datasets, a built-in byte-level corpus, synthetic recall.

Every source maps a *sample index* to ``seq_length + 1`` tokens with no hidden state:
the order is a seeded permutation per epoch. A checkpoint therefore only needs the
number of samples consumed to resume the data stream exactly.

Tokens are byte-level for the built-in sources: ids 0..255 are bytes and
:data:`EOD` (256) ends a document, so the vocabulary is 257 before padding.
"""

from __future__ import annotations

import functools
import os
import struct
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

EOD = 256
BYTE_VOCAB = 257

# synthetic-recall token ranges (all inside the byte vocabulary)
_KEYS = (16, 80)  # 64 possible keys
_VALUES = (80, 144)  # 64 possible values: ln(64) is the loss without recall
_FILLER = (144, 256)
NUM_RECALL_VALUES = _VALUES[1] - _VALUES[0]


def stdlib_files() -> list[str]:
    """The Python standard library's .py sources, in a fixed order (no site-packages)."""
    root = sysconfig.get_paths()["stdlib"]
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages"))
        out += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return out


@functools.lru_cache(maxsize=2)  # the train and the validation split read it once
def builtin_text_tokens(min_tokens: int, budget: int = 8 << 20) -> np.ndarray:
    """Byte tokens of standard-library sources, documents separated by EOD.

    Reads files in order until ``max(budget, min_tokens)`` tokens; no download, and the
    same on every machine with the same Python version.
    """
    want = max(budget, min_tokens)
    parts: list[np.ndarray] = []
    total = 0
    for path in stdlib_files():
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError:
            continue
        parts.append(np.frombuffer(raw, dtype=np.uint8).astype(np.int32))
        parts.append(np.array([EOD], dtype=np.int32))
        total += len(raw) + 1
        if total >= want:
            break
    return np.concatenate(parts)


class DatasetError(ValueError):
    """A Megatron indexed dataset file that cannot be read; the message names the file."""


_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER = 34  # magic 9, version 8, dtype code 1, sequence count 8, document count 8
# megatron.core.datasets.indexed_dataset.DType codes -> item size in bytes
_DTYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}


def check_indexed_dataset(prefix: str) -> None:
    """Check PREFIX.idx and PREFIX.bin before any process starts: both present, the index
    complete, the token file exactly as long as the index says. Reads only the header,
    the last sequence's length and pointer, and the two file sizes (no megatron import).

    Raises :class:`DatasetError` naming the file and what is wrong with it.
    """
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for path in (bin_, idx):
        if not os.path.isfile(path):
            raise DatasetError(f"{path}: not found")
    size = os.path.getsize(idx)
    if size == 0:
        raise DatasetError(f"{idx}: empty file (0 bytes); rebuild the dataset")
    with open(idx, "rb") as f:
        head = f.read(_IDX_HEADER)
        if len(head) < _IDX_HEADER or head[:9] != _IDX_MAGIC:
            raise DatasetError(
                f"{idx}: not a Megatron indexed-dataset index (expected the MMIDIDX header of "
                f"{_IDX_HEADER} bytes, got {size} bytes starting {head[:9]!r})"
            )
        code = head[17]
        n_seq, n_doc = struct.unpack("<QQ", head[18:34])
        if code not in _DTYPE_SIZES:
            raise DatasetError(f"{idx}: unknown token dtype code {code}")
        want = _IDX_HEADER + n_seq * (4 + 8) + n_doc * 8
        if size < want:
            raise DatasetError(
                f"{idx}: truncated: {n_seq} sequences and {n_doc} documents need {want} bytes, "
                f"the file has {size}; rebuild the dataset"
            )
        last_len = last_ptr = 0
        if n_seq:
            f.seek(_IDX_HEADER + (n_seq - 1) * 4)
            (last_len,) = struct.unpack("<i", f.read(4))
            f.seek(_IDX_HEADER + n_seq * 4 + (n_seq - 1) * 8)
            (last_ptr,) = struct.unpack("<q", f.read(8))
    item = _DTYPE_SIZES[code]
    need = last_ptr + last_len * item
    have = os.path.getsize(bin_)
    if have == 0 and need > 0:
        raise DatasetError(f"{bin_}: empty file (0 bytes), but {idx} indexes {need} bytes")
    if have % item:
        raise DatasetError(
            f"{bin_}: {have} bytes is not a whole number of {item}-byte tokens (truncated "
            f"mid-token); {idx} indexes {need} bytes"
        )
    if have < need:
        raise DatasetError(
            f"{bin_}: truncated: {idx} indexes {need} bytes ({need // item} tokens), the file "
            f"has {have}; rebuild the dataset"
        )
    if need == 0:
        raise DatasetError(f"{idx}: indexes no tokens ({n_seq} sequences); nothing to train on")


class IndexedTokens:
    """A Megatron indexed dataset (or several), read as one stream of tokens.

    Uses ``megatron.core.datasets.indexed_dataset.IndexedDataset`` (memory-mapped), so
    existing Megatron data works unchanged and nothing is loaded whole.
    """

    def __init__(self, prefixes: list[str]):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        for p in prefixes:
            check_indexed_dataset(p)
        self.datasets = [IndexedDataset(p) for p in prefixes]
        # (dataset, sequence) in order, and where each starts in the stream
        self._seq: list[tuple[int, int]] = []
        lengths: list[np.ndarray] = []
        for d, ds in enumerate(self.datasets):
            n = len(ds.sequence_lengths)
            self._seq += [(d, i) for i in range(n)]
            lengths.append(np.asarray(ds.sequence_lengths, dtype=np.int64))
        lens = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self._starts = np.concatenate([[0], np.cumsum(lens)])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the stream."""
        out = np.empty(length, dtype=np.int64)
        pos, filled = start, 0
        s = int(np.searchsorted(self._starts, pos, side="right")) - 1
        while filled < length:
            d, i = self._seq[s]
            off = pos - int(self._starts[s])
            take = min(length - filled, int(self._starts[s + 1]) - pos)
            out[filled : filled + take] = self.datasets[d].get(i, offset=off, length=take)
            filled += take
            pos += take
            s += 1
        return out

    def max_token(self) -> int:
        """Largest token id (one pass over the memory map)."""
        return max(
            int(np.memmap(ds.path_prefix + ".bin", dtype=ds.index.dtype, mode="r").max())
            for ds in self.datasets
        )


class ArrayTokens:
    """An in-memory token stream (the built-in corpus)."""

    def __init__(self, tokens: np.ndarray):
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, start: int, length: int) -> np.ndarray:
        return self.tokens[start : start + length].astype(np.int64)


@dataclass
class Sample:
    """One sample: ``tokens``/``labels``/``loss_mask`` of length ``seq_length``."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor


def split_windows(n: int, weights: tuple[float, float, float]) -> tuple[range, range]:
    """The train and validation windows of ``n`` by Megatron's ``--split`` fractions:
    contiguous blocks, train first. A validation weight > 0 gets at least one window
    when there are two or more, so that evaluation always has held-out data."""
    n_train = round(weights[0] * n)
    n_valid = round(weights[1] * n)
    if weights[1] > 0 and n_valid == 0 and n >= 2:
        n_valid = 1
    n_train = min(n_train, n - n_valid)
    return range(0, n_train), range(n_train, n_train + n_valid)


class TextSamples:
    """Non-overlapping windows of ``seq_length + 1`` tokens, shuffled per epoch.

    ``part`` picks the block of windows of Megatron's ``--split``: "train" (the first)
    or "valid" (the next, held out from training).
    """

    def __init__(
        self,
        stream: IndexedTokens | ArrayTokens,
        seq_length: int,
        seed: int,
        split: tuple[float, float, float] = (1.0, 0.0, 0.0),
        part: str = "train",
    ):
        self.stream, self.seq_length, self.seed = stream, seq_length, seed
        total = (len(stream) - 1) // seq_length
        if total < 1:
            raise ValueError(
                f"the data has {len(stream)} tokens, fewer than one sample of --seq-length "
                f"{seq_length} + 1; use more data or a shorter --seq-length"
            )
        train, valid = split_windows(total, split)
        windows = train if part == "train" else valid
        if len(windows) < 1:
            raise ValueError(
                f"--split {split}: the {part} split of {total} samples of --seq-length "
                f"{seq_length} is empty; give it a larger weight, or use more data"
            )
        self.first, self.num_windows = windows.start, len(windows)
        self._perm_epoch = -1
        self._perm = np.zeros(0, np.int64)

    def __getitem__(self, index: int) -> Sample:
        epoch, i = divmod(index, self.num_windows)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._perm_epoch = epoch
        w = self.first + int(self._perm[i])
        x = torch.from_numpy(self.stream.read(w * self.seq_length, self.seq_length + 1))
        return Sample(x[:-1].clone(), x[1:].clone(), torch.ones(self.seq_length))


def recall_positions(seq_length: int, pairs: int) -> tuple[int, int]:
    """Where the pairs are written (0) and where they are queried (the middle)."""
    return 0, seq_length // 2


def recall_layout_error(seq_length: int, cp: int, pairs: int) -> str | None:
    """Why a synthetic-recall layout cannot prove cross-rank flow, or None if it can.

    The pairs must lie in the first zigzag chunk (rank 0) and the queries, from the
    middle of the sequence, in chunk CP, which rank CP-1 holds: for CP >= 2 they are
    on different ranks, so recall needs the scan across ranks.
    """
    if pairs < 1 or pairs > _KEYS[1] - _KEYS[0]:
        return f"--recall-pairs must be in [1, {_KEYS[1] - _KEYS[0]}], got {pairs}"
    chunk = seq_length // (2 * cp)
    if 2 * pairs > chunk:
        need = 2 * pairs * 2 * cp
        return (
            f"--data synthetic-recall: {pairs} pairs take {2 * pairs} tokens, more than one "
            f"zigzag chunk (seq-length / (2 x CP) = {chunk}); use --seq-length >= {need} "
            f"or fewer --recall-pairs"
        )
    return None


class RecallSamples:
    """Key-value pairs at the start, filler, then the same keys queried mid-sequence.

    Only the value predicted right after a queried key counts in the loss; without the
    pairs that value is uniform over 64 ids, so a loss below ln(64) needs information
    from the start of the sequence (rank 0) to reach the query (another rank under CP).
    """

    def __init__(self, seq_length: int, pairs: int, seed: int, part: str = "train"):
        self.seq_length, self.pairs, self.seed = seq_length, pairs, seed
        self._stream = 7 if part == "train" else 8  # held-out samples: another RNG stream

    def __getitem__(self, index: int) -> Sample:
        T, n = self.seq_length, self.pairs
        rng = np.random.default_rng([self.seed, self._stream, index])
        x = rng.integers(*_FILLER, size=T + 1)
        keys = rng.choice(np.arange(*_KEYS), size=n, replace=False)
        vals = rng.integers(*_VALUES, size=n)
        x[0 : 2 * n : 2], x[1 : 2 * n : 2] = keys, vals
        _, q0 = recall_positions(T, n)
        order = rng.permutation(n)
        x[q0 : q0 + 2 * n : 2], x[q0 + 1 : q0 + 2 * n : 2] = keys[order], vals[order]
        x = torch.from_numpy(x.astype(np.int64))
        mask = torch.zeros(T)
        mask[q0 : q0 + 2 * n : 2] = 1.0  # input = queried key, label = its value
        return Sample(x[:-1].clone(), x[1:].clone(), mask)


def build_samples(
    data: str,
    data_path: list[str] | None,
    seq_length: int,
    seed: int,
    recall_pairs: int,
    split: tuple[float, float, float] = (1.0, 0.0, 0.0),
    part: str = "train",
) -> TextSamples | RecallSamples:
    """The sample source a config names; ``part`` "train" or "valid" of ``split``."""
    if data == "synthetic-recall":
        return RecallSamples(seq_length, recall_pairs, seed, part)
    if data_path:
        return TextSamples(IndexedTokens(data_path), seq_length, seed, split, part)
    # enough for 8 samples even at million-token lengths
    tokens = builtin_text_tokens(8 * (seq_length + 1))
    return TextSamples(ArrayTokens(tokens), seq_length, seed, split, part)


def infer_vocab_size(data: str, data_path: list[str] | None) -> int:
    """Vocabulary size before padding."""
    if data_path and data == "text":
        return IndexedTokens(data_path).max_token() + 1
    return BYTE_VOCAB


def microbatches(
    samples: TextSamples | RecallSamples,
    consumed: int,
    global_batch: int,
    micro_batch: int,
    dp_rank: int,
    dp_size: int,
) -> Iterator[dict[str, torch.Tensor]]:
    """This data-parallel rank's microbatches of one global batch, as full sequences.

    Sample ``consumed + (m * dp_size + dp_rank) * micro_batch + j`` goes to microbatch
    m, row j: the same samples reach the same model replica whatever the CP size, so
    runs at different CP sizes see identical data.
    """
    per_step = micro_batch * dp_size
    for m in range(global_batch // per_step):
        base = consumed + (m * dp_size + dp_rank) * micro_batch
        rows = [samples[base + j] for j in range(micro_batch)]
        T = rows[0].tokens.shape[0]
        yield {
            "tokens": torch.stack([r.tokens for r in rows]),
            "labels": torch.stack([r.labels for r in rows]),
            "loss_mask": torch.stack([r.loss_mask for r in rows]),
            "position_ids": torch.arange(T).unsqueeze(0).expand(micro_batch, T).contiguous(),
        }

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
from typing import Any

import numpy as np
import torch
from hla_sp.launch.config import RECALL_FILLERS

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
# megatron.core.datasets.indexed_dataset.DType codes -> numpy dtype
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
           7: np.float32, 8: np.uint16}  # fmt: skip
# index entries checked per block: 12 MiB of lengths and pointers, 8 MiB of documents
VALIDATE_BLOCK = 1 << 20


@dataclass(frozen=True)
class IndexInfo:
    """What a validated index says: token dtype and the counts (no arrays)."""

    prefix: str
    dtype: np.dtype
    sequences: int
    documents: int
    tokens: int


def _read_block(f: Any, offset: int, dtype: type, count: int) -> np.ndarray:
    """``count`` items of ``dtype`` at byte ``offset``, by a plain read (not the memory
    map, whose pages would stay resident: a streamed check must not keep what it read)."""
    out = np.empty(count, dtype=dtype)
    f.seek(offset)
    got = f.readinto(memoryview(out).cast("B"))
    if got != out.nbytes:
        raise DatasetError(f"{f.name}: short read at byte {offset} ({got} of {out.nbytes})")
    return out


def _check_sequences(f: Any, idx: str, bin_: str, n_seq: int, item: int, have: int) -> int:
    """Every length >= 0, every sequence inside the .bin and right after the previous one
    (as Megatron's builder writes them, so that a pointer is the stream offset); return
    the byte where the last sequence ends. Streamed in blocks of :data:`VALIDATE_BLOCK`."""
    len_at, ptr_at = _IDX_HEADER, _IDX_HEADER + 4 * n_seq
    expect = 0  # where the next sequence must start
    for lo in range(0, n_seq, VALIDATE_BLOCK):
        k = min(VALIDATE_BLOCK, n_seq - lo)
        lens = _read_block(f, len_at + 4 * lo, np.int32, k).astype(np.int64)
        ptrs = _read_block(f, ptr_at + 8 * lo, np.int64, k)
        bad = np.flatnonzero(lens < 0)
        if bad.size:
            i = int(bad[0])
            raise DatasetError(
                f"{idx}: sequence {lo + i} has length {int(lens[i])}; expected a length >= 0 "
                f"(a corrupt or crafted index)")
        # bounds first, so that the sums below cannot overflow
        bad = np.flatnonzero((ptrs < 0) | (ptrs > have) | (lens * item > have - ptrs))
        if bad.size:
            i = int(bad[0])
            raise DatasetError(
                f"{idx}: sequence {lo + i} (pointer {int(ptrs[i])}, {int(lens[i])} tokens of "
                f"{item} bytes) lies outside {bin_} ({have} bytes); expected every sequence "
                f"inside the token file: the pair is corrupt, crafted or from two builds")
        starts = np.empty(k, np.int64)
        starts[0] = expect
        starts[1:] = ptrs[:-1] + lens[:-1] * item
        bad = np.flatnonzero(ptrs != starts)
        if bad.size:
            i = int(bad[0])
            raise DatasetError(
                f"{idx}: sequence {lo + i} starts at byte {int(ptrs[i])}, expected "
                f"{int(starts[i])} (right after the previous one, as Megatron's builder writes "
                f"them); the trainer reads the .bin as one stream of tokens")
        expect = int(ptrs[-1] + lens[-1] * item)
    return expect


def _check_documents(f: Any, idx: str, n_seq: int, n_doc: int) -> None:
    """Document boundaries: from 0, non-decreasing, ending at the sequence count."""
    at = _IDX_HEADER + 12 * n_seq
    prev = 0
    for lo in range(0, n_doc, VALIDATE_BLOCK):
        k = min(VALIDATE_BLOCK, n_doc - lo)
        docs = _read_block(f, at + 8 * lo, np.int64, k)
        if lo == 0 and docs[0] != 0:
            raise DatasetError(f"{idx}: document index 0 is {int(docs[0])}, expected 0")
        steps = np.diff(docs, prepend=prev)
        bad = np.flatnonzero((steps < 0) | (docs > n_seq))
        if bad.size:
            i = int(bad[0])
            raise DatasetError(
                f"{idx}: document index {lo + i} is {int(docs[i])}; expected a non-decreasing "
                f"sequence number in [0, {n_seq}] (a corrupt or crafted index)")
        prev = int(docs[-1])
    if n_doc and prev != n_seq:
        raise DatasetError(
            f"{idx}: the last document index is {prev}, expected the sequence count {n_seq}")


_CHECKED: dict[tuple[Any, ...], IndexInfo] = {}


def check_indexed_dataset(prefix: str) -> IndexInfo:
    """Validate PREFIX.idx against PREFIX.bin; return the counts.

    The header and the file sizes first (a crafted count is refused before anything is
    allocated for it), then every sequence's length and pointer and every document
    boundary, read in blocks of :data:`VALIDATE_BLOCK` entries, so memory stays flat
    whatever the index's size. The token file is never read, only its size. A result
    is remembered per file identity (size, mtime, inode), so the trainer's several
    readers of one dataset validate it once per process.

    Raises :class:`DatasetError` naming the file and what is wrong with it.
    """
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for path in (bin_, idx):
        if not os.path.isfile(path):
            raise DatasetError(f"{path}: not found")
    si, sb = os.stat(idx), os.stat(bin_)
    key = (os.path.abspath(prefix), si.st_size, si.st_mtime_ns, si.st_ino, sb.st_size,
           sb.st_mtime_ns, sb.st_ino)  # fmt: skip
    if key in _CHECKED:
        return _CHECKED[key]
    size, have = si.st_size, sb.st_size
    if size == 0:
        raise DatasetError(f"{idx}: empty file (0 bytes); rebuild the dataset")
    with open(idx, "rb") as f:
        head = f.read(_IDX_HEADER)
        if len(head) < _IDX_HEADER or head[:9] != _IDX_MAGIC:
            raise DatasetError(
                f"{idx}: not a Megatron indexed-dataset index (expected the MMIDIDX header of "
                f"{_IDX_HEADER} bytes, got {size} bytes starting {head[:9]!r})"
            )
        (version,) = struct.unpack("<Q", head[9:17])
        if version != 1:
            raise DatasetError(f"{idx}: index version {version}, expected 1")
        code = head[17]
        n_seq, n_doc = struct.unpack("<QQ", head[18:34])
        if code not in _DTYPES:
            raise DatasetError(
                f"{idx}: unknown token dtype code {code}, expected one of {sorted(_DTYPES)}")
        want = _IDX_HEADER + n_seq * (4 + 8) + n_doc * 8
        if size < want:
            raise DatasetError(
                f"{idx}: truncated: {n_seq} sequences and {n_doc} documents need {want} bytes, "
                f"the file has {size}; rebuild the dataset"
            )
        dtype = np.dtype(_DTYPES[code])
        item = dtype.itemsize
        if have % item:
            raise DatasetError(
                f"{bin_}: {have} bytes is not a whole number of {item}-byte tokens (truncated "
                f"mid-token)"
            )
        # the last sequence says how long the .bin must be: a short one is "truncated"
        # (the usual accident), before the whole-index check names a single entry
        last_len = last_ptr = 0
        if n_seq:
            last_len = int(_read_block(f, _IDX_HEADER + 4 * (n_seq - 1), np.int32, 1)[0])
            last_ptr = int(_read_block(f, _IDX_HEADER + 12 * n_seq - 8, np.int64, 1)[0])
        need = last_ptr + last_len * item
        if have == 0 and need > 0:
            raise DatasetError(f"{bin_}: empty file (0 bytes), but {idx} indexes {need} bytes")
        if last_ptr >= 0 and last_len >= 0 and have < need:
            raise DatasetError(
                f"{bin_}: truncated: {idx} indexes {need} bytes ({need // item} tokens), the "
                f"file has {have}; rebuild the dataset"
            )
        end = _check_sequences(f, idx, bin_, n_seq, item, have)
        _check_documents(f, idx, n_seq, n_doc)
    if end == 0:
        raise DatasetError(f"{idx}: indexes no tokens ({n_seq} sequences); nothing to train on")
    info = IndexInfo(prefix, dtype, n_seq, n_doc, end // item)
    _CHECKED[key] = info
    return info


def parse_data_path(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's ``--data-path``: prefixes, or weight-prefix pairs (``0.5 A 0.5 B``).

    Parsed by megatron-core's own ``get_blend_from_list``; the weights are then checked
    (finite, >= 0, not all 0) and normalised to sum to 1.
    """
    from megatron.core.datasets.utils import get_blend_from_list

    if len(data_path) % 2 == 0:
        # megatron-core reads an even list as weight-prefix pairs when every first of a
        # pair is a number, as prefixes when none is; a mix fails its bare assert
        firsts = data_path[::2]
        numbers = [_is_number(w) for w in firsts]
        if any(numbers) and not all(numbers):
            bad = next(w for w, n in zip(firsts, numbers, strict=True) if not n)
            raise DatasetError(
                f"--data-path {' '.join(data_path)}: expected a number before each prefix "
                f"(as 0.5 A 0.5 B) or prefixes alone (A B), got {bad!r} where a weight goes")
    blend = get_blend_from_list(list(data_path))
    if blend is None:
        raise DatasetError(f"--data-path: expected prefixes, got {data_path!r}")
    prefixes, weights = blend
    if weights is None:
        return prefixes, None
    if any(not np.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise DatasetError(
            f"--data-path {' '.join(data_path)}: expected weights >= 0, not all 0, before each "
            f"prefix (as 0.5 A 0.5 B), got {weights}")
    total = float(sum(weights))
    return prefixes, [w / total for w in weights]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class IndexedTokens:
    """A Megatron indexed dataset (or several, concatenated), read as one stream of tokens.

    Opening is O(1) in the number of sequences: the index is validated in streamed
    blocks (:func:`check_indexed_dataset`) and, since the sequences are contiguous in the
    .bin, a stream offset *is* a token offset in the .bin: reads go straight to
    megatron-core's ``IndexedDataset`` bin reader (a memory map), and no per-sequence
    array or object is ever built. Token ids are checked against ``vocab_size`` as they
    are read, so nothing scans the whole .bin at start-up.
    """

    def __init__(self, prefixes: list[str], vocab_size: int | None = None):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.infos = [check_indexed_dataset(p) for p in prefixes]
        self.datasets = [IndexedDataset(p) for p in prefixes]
        self.vocab_size = vocab_size
        # where each dataset starts in the stream (one entry per prefix)
        self._starts = np.cumsum([0] + [i.tokens for i in self.infos], dtype=np.int64)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the stream, as int64."""
        out = np.empty(length, dtype=np.int64)
        pos, filled = start, 0
        d = int(np.searchsorted(self._starts, pos, side="right")) - 1
        while filled < length:
            info, ds = self.infos[d], self.datasets[d]
            off = pos - int(self._starts[d])
            take = min(length - filled, info.tokens - off)
            part = ds.bin_reader.read(info.dtype, take, off * info.dtype.itemsize)
            self._check_ids(part, d, off)
            out[filled : filled + take] = part
            filled += take
            pos += take
            d += 1
        return out

    def _check_ids(self, part: np.ndarray, d: int, off: int) -> None:
        """Token ids in [0, vocab_size): an id outside the embedding table would index
        past it (a device-side assert on CUDA)."""
        if self.vocab_size is None or part.size == 0:
            return
        bad = np.flatnonzero((part < 0) | (part >= self.vocab_size))
        if bad.size:
            i = int(bad[0])
            raise DatasetError(
                f"{self.infos[d].prefix}.bin: token {off + i} is {part[i].item()!r}, outside the "
                f"vocabulary [0, {self.vocab_size}); pass --vocab-size with the size of the "
                f"tokenizer that built the data (the default, {BYTE_VOCAB}, is the byte-level "
                f"vocabulary of make_dataset)")

    def max_token(self, limit: int = 1 << 26) -> int:
        """Largest token id in the first ``limit`` tokens of the stream (a spot check for
        tools and tests; training never scans the .bin)."""
        n = min(len(self), limit)
        return int(self.read(0, n).max()) if n else -1



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
        infos = getattr(stream, "infos", None)
        what = (f"--data-path {' '.join(i.prefix for i in infos)}" if infos
                else "the built-in text")
        if total < 1:
            raise DatasetError(
                f"{what}: expected at least one sample of --seq-length {seq_length} + 1 "
                f"tokens, got {len(stream)} tokens; use more data or a shorter --seq-length"
            )
        train, valid = split_windows(total, split)
        windows = train if part == "train" else valid
        if len(windows) < 1:
            raise DatasetError(
                f"--split: the {part} split of {what} ({total} samples of --seq-length "
                f"{seq_length}) is empty with the fractions {tuple(round(x, 4) for x in split)};"
                f" give it a larger weight, or use more data"
            )
        self.first, self.num_windows = windows.start, len(windows)
        self._perm_epoch = -1
        self._perm = np.zeros(0, np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        """The epoch's order of windows: ``Generator.permutation(n)``'s exact order, shuffled
        in place in int32 when it fits (4 bytes per window instead of 8)."""
        rng = np.random.default_rng([self.seed, epoch])
        small = self.num_windows <= np.iinfo(np.int32).max
        perm = np.arange(self.num_windows, dtype=np.int32 if small else np.int64)
        rng.shuffle(perm)
        return perm

    def __getitem__(self, index: int) -> Sample:
        epoch, i = divmod(index, self.num_windows)
        if epoch != self._perm_epoch:
            self._perm = self._permutation(epoch)
            self._perm_epoch = epoch
        w = self.first + int(self._perm[i])
        x = torch.from_numpy(self.stream.read(w * self.seq_length, self.seq_length + 1))
        return Sample(x[:-1].clone(), x[1:].clone(), torch.ones(self.seq_length))


class BlendedSamples:
    """Megatron's weighted blend of several sample sources (``--data-path 0.5 A 0.5 B``).

    Sample ``i`` comes from the source and position megatron-core's
    ``helpers.build_blending_indices`` gives it (the order of Megatron's
    ``BlendedDataset``: each sample goes to the source furthest below its share). That
    order is prefix-stable, so the indices are built for the samples asked for so far
    and doubled when a larger index comes; the sample stays a function of its index.
    """

    def __init__(self, sources: list[TextSamples], weights: list[float]):
        if len(sources) > np.iinfo(np.int16).max:
            raise DatasetError(f"--data-path: at most {np.iinfo(np.int16).max} weighted prefixes")
        self.sources, self.weights = sources, np.asarray(weights, dtype=np.float64)
        self._dataset = np.zeros(0, np.int16)
        self._sample = np.zeros(0, np.int64)

    def _grow(self, size: int) -> None:
        from megatron.core.datasets import helpers

        size = max(size, 2 * len(self._dataset), 1024)
        dataset = np.zeros(size, dtype=np.int16)
        sample = np.zeros(size, dtype=np.int64)
        helpers.build_blending_indices(dataset, sample, self.weights, len(self.sources),
                                       size, False)
        self._dataset, self._sample = dataset, sample

    def __getitem__(self, index: int) -> Sample:
        if index >= len(self._dataset):
            self._grow(index + 1)
        return self.sources[int(self._dataset[index])][int(self._sample[index])]


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
    ``filler`` "random" draws every other token afresh from 112 ids; "constant" repeats
    one id, as Zoology's MQAR does, and keeps the same pairs and queries per index.
    """

    def __init__(self, seq_length: int, pairs: int, seed: int, part: str = "train",
                 filler: str = "random"):
        if filler not in RECALL_FILLERS:
            raise ValueError(f"--recall-filler: expected one of {RECALL_FILLERS}, got {filler!r}")
        self.seq_length, self.pairs, self.seed, self.filler = seq_length, pairs, seed, filler
        self._stream = 7 if part == "train" else 8  # held-out samples: another RNG stream

    def __getitem__(self, index: int) -> Sample:
        T, n = self.seq_length, self.pairs
        rng = np.random.default_rng([self.seed, self._stream, index])
        x = rng.integers(*_FILLER, size=T + 1)
        if self.filler == "constant":
            # drawn all the same, so both fillers hold the same pairs for one index
            x[:] = _FILLER[0]
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
    vocab_size: int | None = None,
    recall_filler: str = "random",
) -> TextSamples | RecallSamples | BlendedSamples:
    """The sample source a config names; ``part`` "train" or "valid" of ``split``.

    ``data_path`` as Megatron's ``--data-path``: prefixes are concatenated into one
    stream; weight-prefix pairs are blended by weight, each prefix split on its own (as
    Megatron's ``BlendedMegatronDatasetBuilder`` splits each dataset before blending).
    Token ids of indexed data are checked against ``vocab_size`` (default: the
    byte-level vocabulary) as they are read.
    """
    if data == "synthetic-recall":
        return RecallSamples(seq_length, recall_pairs, seed, part, recall_filler)
    if data_path:
        prefixes, weights = parse_data_path(data_path)
        vocab = vocab_size or BYTE_VOCAB
        if weights is None:
            return TextSamples(IndexedTokens(prefixes, vocab), seq_length, seed, split, part)
        # each source its own seed stream, so that two equal prefixes do not move in step;
        # a source of weight 0 supplies nothing (megatron-core's blending index would
        # still give it a sample early on), and keeps its seed out of the others' way
        kept = [(i, p, w) for i, (p, w) in enumerate(zip(prefixes, weights, strict=True))
                if w > 0]
        sources = [TextSamples(IndexedTokens([p], vocab), seq_length, seed + i, split, part)
                   for i, p, _ in kept]
        if len(sources) == 1:
            return sources[0]
        return BlendedSamples(sources, [w for _, _, w in kept])
    # enough for 8 samples even at million-token lengths
    tokens = builtin_text_tokens(8 * (seq_length + 1))
    return TextSamples(ArrayTokens(tokens), seq_length, seed, split, part)


def infer_vocab_size(data: str, data_path: list[str] | None) -> int:
    """Vocabulary size before padding when --vocab-size is not given: the byte-level
    vocabulary (what make_dataset writes). As in Megatron, the vocabulary comes from the
    tokenizer or a flag, never from scanning the data; ids outside it are refused when
    read, naming the file and the flag."""
    return BYTE_VOCAB


def microbatches(
    samples: TextSamples | RecallSamples | BlendedSamples,
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

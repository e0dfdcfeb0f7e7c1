"""Megatron indexed datasets (``.idx`` / ``.bin``): the index checked in streamed blocks
(:func:`check_indexed_dataset`, one line naming the file and the fault), and the
tokens read as one stream (:class:`IndexedTokens`) without a per-sequence array."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
from hla_sp.launch.errors import DatasetError

__all__ = ["BYTE_VOCAB", "EOD", "VALIDATE_BLOCK", "IndexInfo", "IndexedTokens",
           "check_indexed_dataset"]

# Byte-level tokens (make_dataset, the built-in corpus): ids 0..255 are bytes, EOD ends
# a document, so the vocabulary is 257 before padding.
EOD = 256
BYTE_VOCAB = 257


_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER = 34  # magic 9, version 8, dtype code 1, sequence count 8, document count 8
# megatron.core.datasets.indexed_dataset.DType codes -> numpy dtype
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
           7: np.float32, 8: np.uint16}  # fmt: skip
# index entries checked per block: 12 MiB of lengths and pointers, 8 MiB of documents
VALIDATE_BLOCK = 1 << 20


def megatron_datasets(blending: bool = False) -> SimpleNamespace:
    """megatron-core's dataset pieces, imported on first use: the data subpackage's one
    import of megatron-core (the megatron extra). ``IndexedDataset`` (the .bin reader),
    ``IndexedDatasetBuilder`` (the writer), ``get_blend_from_list`` (``--data-path``);
    with ``blending``, also ``helpers``, the compiled blending indices (built in the wheel,
    not in a source checkout, so only weighted blends ask for them)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    from megatron.core.datasets.utils import get_blend_from_list

    pieces = SimpleNamespace(IndexedDataset=IndexedDataset,
                             IndexedDatasetBuilder=IndexedDatasetBuilder,
                             get_blend_from_list=get_blend_from_list)
    if blending:
        from megatron.core.datasets import helpers

        pieces.helpers = helpers
    return pieces


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
        self.infos = [check_indexed_dataset(p) for p in prefixes]
        self.datasets = [megatron_datasets().IndexedDataset(p) for p in prefixes]
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

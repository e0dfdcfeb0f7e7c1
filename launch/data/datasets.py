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
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hla_sp.launch.config.flags import is_number
from hla_sp.launch.config.train_config import TrainConfig
from hla_sp.launch.data.config import RECALL_FILLERS

# The byte-level ids (0..255 bytes, EOD 256) live with the dataset reader, which names
# the byte vocabulary in its errors; they are this module's too.
from hla_sp.launch.data.indexed_dataset import BYTE_VOCAB, EOD, IndexedTokens, megatron_datasets
from hla_sp.launch.errors import DatasetError

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



def parse_data_path(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's ``--data-path``: prefixes, or weight-prefix pairs (``0.5 A 0.5 B``).

    Parsed by megatron-core's own ``get_blend_from_list``; the weights are then checked
    (finite, >= 0, not all 0) and normalised to sum to 1.
    """
    if len(data_path) % 2 == 0:
        # megatron-core reads an even list as weight-prefix pairs when every first of a
        # pair is a number, as prefixes when none is; a mix fails its bare assert
        firsts = data_path[::2]
        numbers = [is_number(w) for w in firsts]
        if any(numbers) and not all(numbers):
            bad = next(w for w, n in zip(firsts, numbers, strict=True) if not n)
            raise DatasetError(
                f"--data-path {' '.join(data_path)}: expected a number before each prefix "
                f"(as 0.5 A 0.5 B) or prefixes alone (A B), got {bad!r} where a weight goes")
    blend = megatron_datasets().get_blend_from_list(list(data_path))
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
        size = max(size, 2 * len(self._dataset), 1024)
        dataset = np.zeros(size, dtype=np.int16)
        sample = np.zeros(size, dtype=np.int64)
        megatron_datasets(blending=True).helpers.build_blending_indices(
            dataset, sample, self.weights, len(self.sources), size, False)
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


def config_samples(cfg: TrainConfig, part: str = "train") -> Any:
    """The sample source of one split (train, valid) of the config's data."""
    d = cfg.data
    return build_samples(d.data, d.data_path, cfg.model.seq_length, cfg.optimizer.seed,
                         d.recall_pairs, d.split_weights, part=part,
                         vocab_size=cfg.model.vocab_size, recall_filler=d.recall_filler)

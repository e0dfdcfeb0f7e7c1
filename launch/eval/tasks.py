"""What ``hla-sp eval`` feeds the model: its lengths, the held-out windows of
``ppl-by-position`` and their position buckets, and the prompts of ``passkey``.

Everything here is a function of the flags and the seed, so every rank (and every CP
size) builds the same sequences; :mod:`hla_sp.launch.eval.run` runs them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from hla_sp.launch.data.datasets import ArrayTokens, builtin_text_tokens, parse_data_path
from hla_sp.launch.data.indexed_dataset import BYTE_VOCAB, IndexedTokens
from hla_sp.launch.data.tokenizer import TokenizerError, check_data_tokenizer, load_run_tokenizer
from hla_sp.launch.errors import ConfigError, DatasetError

if TYPE_CHECKING:
    from hla_sp.launch.data.tokenizer import RunTokenizer

_UNITS = {"": 1, "k": 1024, "m": 1024**2}


def parse_lengths(text: str) -> list[int]:
    """``--lengths 4k,16k,1M``: token counts (k = 1024, M = 1024²), in the order given."""
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", part)
        n = int(m.group(1)) * _UNITS[m.group(2).lower()] if m else 0
        if n < 2:
            raise ConfigError(f"--lengths: expected comma-separated token counts >= 2 such as "
                              f"4k,16k,1M (k = 1024, M = 1024²), got {part.strip()!r}")
        out.append(n)
    if len(set(out)) != len(out):
        raise ConfigError(f"--lengths: expected each length once, got {text!r}")
    return out


def short(n: int) -> str:
    """A token count as --lengths writes it: 4096 -> 4k, 1048576 -> 1M, 1000 -> 1000."""
    for unit, size in (("M", 1024**2), ("k", 1024)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def check_lengths(lengths: list[int], cp: int, positions: int | None, kind: str) -> None:
    """Each length splits into Megatron's 2 x CP zigzag chunks (refused, not rounded, so a
    length means what it says), and fits a learned position table of ``positions``."""
    bad = [n for n in lengths if n % (2 * cp)]
    if bad:
        n = bad[0]
        lo = n // (2 * cp) * (2 * cp)
        raise ConfigError(
            f"--lengths: expected lengths divisible by 2 x --context-parallel-size = {2 * cp} "
            f"(Megatron's zigzag split), got {', '.join(map(str, bad))}; use e.g. "
            f"{lo or 2 * cp} or {lo + 2 * cp} for {n}")
    over = [n for n in lengths if positions is not None and n > positions]
    if over:
        raise ConfigError(
            f"--lengths: the checkpoint's {kind} position table ends at {positions} tokens "
            f"(its --max-position-embeddings, else --seq-length), got "
            f"{', '.join(short(n) for n in over)}; use lengths <= {positions}, or a model with "
            f"rope or none positions, which run at any length")


def buckets(length: int, first: int) -> list[tuple[int, int]]:
    """Log-spaced position buckets [lo, hi) covering 0..length: [0, first), then each
    twice as long as the one before ([first, 2 first), [2 first, 4 first), ...); the last
    is cut at ``length``."""
    out, lo, hi = [], 0, first
    while lo < length:
        out.append((lo, min(hi, length)))
        lo, hi = hi, 2 * hi
    return out


def bucket_of(positions: torch.Tensor, first: int) -> torch.Tensor:
    """The bucket index of each position (int64, any shape), as :func:`buckets` numbers
    them: 0 below ``first``, then 1 + floor(log2(position // first))."""
    out = torch.zeros_like(positions)
    big = positions >= first
    # exact: the quotient is an integer below 2**53, whose log2 a double floors right
    out[big] = torch.log2((positions[big] // first).double()).floor().long() + 1
    return out


# ---------------------------------------------------------------- held-out text


@dataclass(frozen=True)
class TextWindows:
    """``ppl-by-position``'s windows: sample i at every length starts at token
    ``start + i * stride`` of ``stream`` (stride = the longest length + 1), so the
    positions two lengths share cover the same text."""

    stream: Any  # ArrayTokens or IndexedTokens: len() and read(start, length)
    start: int
    stride: int
    source: str

    def window(self, i: int, length: int) -> np.ndarray:
        """Tokens [length + 1] of sample ``i``: the inputs and, shifted by one, the labels."""
        return self.stream.read(self.start + i * self.stride, length + 1)


def text_windows(cfg: Any, data_path: list[str] | None, samples: int, longest: int
                 ) -> TextWindows:
    """The held-out windows, checked to exist: ``--data-path`` from its first token, or
    the built-in text (the standard library's sources, one document each, joined with
    EOD) from the first file past the corpus a training run at the checkpoint's
    --seq-length reads, which no such run has seen."""
    need = samples * (longest + 1)
    vocab = cfg.model.vocab_size or BYTE_VOCAB
    if data_path:

        prefixes, weights = parse_data_path(data_path)
        if weights is not None:
            raise ConfigError(f"--data-path: expected prefixes (read one after the other), got "
                              f"weights {' '.join(data_path)}")
        for prefix in prefixes:
            try:  # the tokenizer that made the data (its PREFIX.json) is the model's
                check_data_tokenizer(prefix, cfg)
            except TokenizerError as e:
                raise ConfigError(f"the checkpoint's {e}") from None
        stream: Any = IndexedTokens(prefixes, vocab)
        start, source = 0, f"--data-path {' '.join(prefixes)}"
        have = len(stream)
    else:
        if cfg.model.tokenizer not in (None, "bytes"):
            raise ConfigError(f"--task ppl-by-position: the built-in text is byte-level, the "
                              f"checkpoint's tokenizer is {cfg.model.tokenizer}; pass --data-path "
                              f"with data that make-dataset --tokenizer built")
        start = len(builtin_text_tokens(8 * (cfg.model.seq_length + 1)))
        tokens = builtin_text_tokens(start + need)
        stream, source = ArrayTokens(tokens), "built-in held-out text (Python standard library)"
        have = len(tokens)
    if have - start < need:
        raise DatasetError(
            f"--samples {samples} x (longest --lengths {longest} + 1) = {need:,} tokens: the "
            f"{source} holds {max(have - start, 0):,} past token {start:,}; lower --samples or "
            f"the longest length" + ("" if data_path else ", or pass --data-path"))
    return TextWindows(stream, start, longest + 1, source)


# ---------------------------------------------------------------- passkey


def run_tokenizer(cfg: Any) -> RunTokenizer:
    """The tokenizer of the run that wrote the checkpoint (its config's --tokenizer;
    bytes by default), which writes the passkey prompts."""
    return load_run_tokenizer(cfg)


# filler sentences (each ends with a space, so any cut between two is a sentence boundary)
FILLER = (
    "The lamps along the quay were lit one by one. ",
    "A cart rolled over the bridge and on into town. ",
    "Gulls circled the harbour wall and settled again. ",
    "Somebody was whistling in the yard behind the mill. ",
    "The tide came in slowly over the flat grey sand. ",
    "A bell rang twice from the tower and then stopped. ",
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is "


@dataclass(frozen=True)
class Passkey:
    """One passkey sequence of ``length + 1`` tokens: EOD, filler with the needle at
    token ``needle_at``, the question, and the key's tokens last (the scored labels)."""

    tokens: np.ndarray  # [length + 1]
    key: str
    needle_at: int
    answer_tokens: int


def passkey_minimum(tok: RunTokenizer) -> int:
    """The shortest length a passkey sequence fits in (no filler)."""
    key = "99999"
    return (1 + len(tok.encode(NEEDLE.format(key=key))) + len(tok.encode(QUESTION))
            + len(tok.encode(key)) - 1)


def passkey(tok: RunTokenizer, length: int, depth: float, seed: int, depth_index: int,
            sample: int) -> Passkey:
    """The seeded passkey sequence for (length, depth, sample): a 5-digit key, the filler
    (whole sentences from a random one on, the first cut to fit), the needle at the
    sentence boundary nearest ``depth`` of the filler (0: first, 1: right before the
    question)."""
    rng = np.random.default_rng([seed, length, depth_index, sample])
    key = str(int(rng.integers(10000, 100000)))
    needle, question, answer = (tok.encode(NEEDLE.format(key=key)), tok.encode(QUESTION),
                                tok.encode(key))
    n = length + 1 - 1 - len(needle) - len(question) - len(answer)
    if n < 0:
        raise ConfigError(f"--lengths: {length} is too short for the passkey prompt (at least "
                          f"{passkey_minimum(tok)} tokens)")
    sentences = [tok.encode(s) for s in FILLER]
    filler: list[int] = []
    bounds = [0]
    i = int(rng.integers(len(FILLER)))
    while len(filler) < n:
        filler += sentences[i % len(FILLER)]
        bounds.append(len(filler))
        i += 1
    # cut at the front, so that the text reads on into the needle and the question
    # (a window from the middle of a text, as the held-out windows are)
    drop = len(filler) - n
    filler = filler[drop:]
    bounds = [0] + [b - drop for b in bounds if b > drop]
    cut = min(bounds, key=lambda b: (abs(b - depth * n), b))
    seq = [tok.eod, *filler[:cut], *needle, *filler[cut:], *question, *answer]
    assert len(seq) == length + 1, (len(seq), length)
    return Passkey(np.asarray(seq, dtype=np.int64), key, 1 + cut, len(answer))


def parse_depths(text: str) -> list[float]:
    """``--depths 0,0.25,0.5,0.75,1``: fractions of the filler before the needle."""
    out = []
    for part in text.split(","):
        try:
            d = float(part)
        except ValueError:
            d = math.nan
        if not 0.0 <= d <= 1.0:
            raise ConfigError(f"--depths: expected comma-separated fractions in [0, 1] such "
                              f"as 0,0.25,0.5,0.75,1, got {part.strip()!r}")
        out.append(d)
    return out

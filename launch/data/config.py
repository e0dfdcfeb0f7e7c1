"""The data's config section, [data]: the source (built-in text, synthetic, Megatron
indexed datasets), the split, synthetic recall. The files themselves are checked by
:mod:`hla_sp.launch.checks`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hla_sp.launch.config.sections import Section
from hla_sp.launch.errors import ConfigError

__all__ = ["RECALL_FILLERS", "DataConfig", "split_weights"]


# The filler layouts of --data synthetic-recall (launch/data/datasets.py's RecallSamples).
RECALL_FILLERS = ("random", "constant")


def split_weights(split: str) -> tuple[float, float, float]:
    """Megatron's ``--split`` ("969,30,1", "90,10" or "100") as fractions summing to 1."""
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or any(not x >= 0 for x in parts) or sum(parts) <= 0:
        raise ConfigError(
            f"--split: expected up to three weights train,valid,test such as 969,30,1, "
            f"got {split!r}"
        )
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return parts[0] / total, parts[1] / total, parts[2] / total


@dataclass
class DataConfig(Section):
    """The training data and its split ([data])."""

    data: str = "text"
    """text (Megatron data from --data-path, else the Python standard library's sources
    as bytes) or synthetic-recall (key-value pairs early, queried in the second half;
    the loss can only fall below ln(64) if information crosses context-parallel ranks)."""
    data_path: list[str] | None = None
    """Prefixes of Megatron indexed datasets (PREFIX.bin and PREFIX.idx), concatenated;
    or weight-prefix pairs as Megatron takes them (0.5 A 0.5 B), blended by weight."""
    recall_pairs: int = 8
    """Key-value pairs per sample for --data synthetic-recall."""
    recall_filler: str = "random"
    """The tokens around the pairs and queries of --data synthetic-recall: random (a
    fresh id per position, so the state must also learn to ignore noise) or constant
    (one id everywhere, the filler of Zoology's MQAR)."""
    split: str = "969,30,1"
    """Train, validation and test weights of the data (Megatron's --split): the first
    share of the samples trains, the next is the held-out validation set."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "data": ("text", "synthetic-recall"),
        "recall_filler": RECALL_FILLERS,
    }

    @property
    def split_weights(self) -> tuple[float, float, float]:
        """--split as train, valid and test fractions summing to 1."""
        return split_weights(self.split)

    def validate(self) -> None:
        """The choices, --split, and --data-path only with --data text."""
        super().validate()
        split_weights(self.split)
        if self.data_path and self.data != "text":
            raise ConfigError("--data-path goes with --data text; drop one of them.")

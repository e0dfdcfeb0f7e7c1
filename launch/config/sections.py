"""What every config section is: :class:`Section` (its ranges, choices and
:meth:`~Section.validate`), one dataclass per section, one docstring per field, which is
the flag's ``--help``. Each section sits beside its owner: ``[model]`` in
:mod:`hla_sp.launch.model.config`, ``[optimizer]``, ``[precision]``, ``[evaluation]``,
``[logging]`` and ``[performance]`` in :mod:`hla_sp.launch.train.config`,
``[parallelism]`` in :mod:`hla_sp.launch.distributed.config`, ``[data]`` in
:mod:`hla_sp.launch.data.config`, ``[checkpoint]`` in
:mod:`hla_sp.launch.checkpoint.config`; :class:`~.train_config.TrainConfig` holds them
all, and :mod:`hla_sp.launch.checks` checks them against each other.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from hla_sp.launch.errors import ConfigError

__all__ = ["FP32_MAX", "HLA_FLAG", "Range", "Section", "check_ranges"]

# Field metadata of a model field whose flag add_hla_args / add_hybrid_args defines
# (the one definition of the HLA flags, which Megatron's pretrain_gpt shares).
HLA_FLAG = {"hla_flag": True}

FP32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max, without importing torch

# (lo, hi) ends: "[" / "(" closed / open; hi None: unbounded. None values are skipped.
Range = tuple[str, float, float | None, str]


def check_ranges(section: Any) -> None:
    """Every numeric field of ``section`` in its ``RANGES`` entry, finite, named as the
    flag it is on the command line."""
    for name, (lb, lo, hi, rb) in section.RANGES.items():
        v = getattr(section, name)
        if v is None:
            continue
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        ok = ok and (v >= lo if lb == "[" else v > lo)
        if hi is not None:
            ok = ok and (v <= hi if rb == "]" else v < hi)
        if not ok:
            want = f"{lb}{lo}, {'inf' if hi is None else hi}{rb}"
            raise ConfigError(
                f"--{name.replace('_', '-')}: expected a finite value in {want}, got {v!r}"
            )


class Section:
    """What every section has: its ranges and choices, and :meth:`validate`."""

    RANGES: ClassVar[dict[str, Range]] = {}
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {}

    def validate(self) -> None:
        """Refuse, in one line naming the flag, what this section alone shows is wrong."""
        check_ranges(self)
        for name, choices in self.CHOICES.items():
            v = getattr(self, name)
            if v is not None and v not in choices:
                raise ConfigError(f"--{name.replace('_', '-')}: expected one of "
                                  f"{list(choices)}, got {v!r}")

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-friendly dict."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]

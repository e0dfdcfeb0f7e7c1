"""Errors of a known kind (a flag, a checkpoint, a data file): said in one line, once.

A worker under ``hla-sp train`` writes such an error to the directory that
:mod:`hla_sp.launch.torchrun` names in :data:`REPORT_ENV`; the launcher reads the
reports back and prints each distinct message once, without torchrun's summary.
``HLA_SP_DEBUG=1`` (``hla-sp train --debug``) asks for tracebacks instead. Torch-free,
so that the launcher reads it before torch is imported.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

# ``HLA_SP_DEBUG=1`` (``hla-sp train --debug``): tracebacks for every error, and
# torchrun's own failure summary, as without hla-sp's one-line reports.
DEBUG_ENV = "HLA_SP_DEBUG"
# set by ``hla_sp.launch.torchrun`` for its workers: where a worker that stops on an
# error of a known kind writes it (rank<N>.json), so that the launcher prints it once
REPORT_ENV = "HLA_SP_REPORT_DIR"
# a known error's exit status (argparse's, and the launcher's for a bad flag)
KNOWN_EXIT = 2


class ConfigError(ValueError):
    """A flag or flag combination that cannot work; the message says what to change."""


class DatasetError(ValueError):
    """A Megatron indexed dataset file that cannot be read; the message names the file."""


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be read; the message names the file."""


def debug() -> bool:
    """Whether tracebacks were asked for (``HLA_SP_DEBUG`` set to anything but 0/empty)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def reporting() -> bool:
    """Whether this process is a worker whose launcher reads its reports (the report
    directory exists and no tracebacks were asked for)."""
    where = os.environ.get(REPORT_ENV)
    return bool(where) and os.path.isdir(where) and not debug()


def known_kinds() -> tuple[type[BaseException], ...]:
    """The errors whose message says everything (a flag, a checkpoint, a data file):
    reported in one line, without a traceback or a diagnosis of the peers."""
    return (ConfigError, CheckpointError, DatasetError)


def write_report(where: str, rank: int, kind: str, message: str) -> bool:
    """Write one worker's known error to ``where`` (whole or not at all); False if it
    could not be written (the caller then prints it itself)."""
    tmp = os.path.join(where, f".rank{rank}.json.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump({"rank": rank, "kind": kind, "message": message}, f)
        os.replace(tmp, os.path.join(where, f"rank{rank}.json"))
    except OSError:
        return False
    return True


def read_reports(where: str) -> list[dict[str, Any]]:
    """The known errors the workers wrote to ``where`` (:data:`REPORT_ENV`), by rank."""
    out = []
    try:
        names = sorted(os.listdir(where))
    except OSError:
        return []
    for name in names:
        if name.startswith("rank") and name.endswith(".json"):
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(where, name)) as f:
                    rep = json.load(f)
                if isinstance(rep, dict) and isinstance(rep.get("message"), str):
                    out.append(rep)
    return sorted(out, key=lambda r: int(r.get("rank", 0)))


def summarize_reports(reports: list[dict[str, Any]]) -> list[str]:
    """One line per distinct message: a failure every rank raised is said once."""
    by_msg: dict[str, list[int]] = {}
    for rep in reports:
        by_msg.setdefault(rep["message"], []).append(int(rep.get("rank", 0)))
    if len(by_msg) == 1:
        return list(by_msg)
    return [f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {m}"
            for m, r in by_msg.items()]


@dataclass
class Failure:
    """One worker's unexpected error, as it reports it to the launcher."""

    rank: int
    world_size: int
    own: bool  # this rank's own error (not a collective's that a peer may have caused)
    error: str  # "Type: first line" of the root cause
    where: str  # "0.1 s into iteration 3" or "while saving iteration 2"
    lines: list[str]  # what the worker would have printed, in order
    traceback: str = ""  # empty where no traceback helps (a stop from outside, an OOM)
    time: float = field(default_factory=time.time)


def write_failure(where: str, failure: Failure) -> bool:
    """Write ``failure`` to the report directory (whole or not at all); False if it
    could not be written (the worker then prints it itself)."""
    tmp = os.path.join(where, f".failure{failure.rank}.json.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(asdict(failure), f)
        os.replace(tmp, os.path.join(where, f"failure{failure.rank}.json"))
    except (OSError, TypeError, ValueError):
        return False
    return True


def read_failures(where: str) -> list[Failure]:
    """The unexpected errors the workers wrote to ``where``, the first failure first:
    a rank's own error before a collective's (whose cause is a peer), then by time."""
    out = []
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(where)):
            if name.startswith("failure") and name.endswith(".json"):
                with contextlib.suppress(OSError, ValueError, TypeError), \
                        open(os.path.join(where, name)) as f:
                    out.append(Failure(**json.load(f)))
    return sorted(out, key=lambda x: (not x.own, x.time, x.rank))


def summarize_failures(failures: list[Failure], prog: str) -> tuple[str, str]:
    """(the first failure's traceback, one summary line) for a run whose workers failed
    on unexpected errors; the later ranks' reports are folded into the line."""
    first = failures[0]
    # "raised as", the diagnosis and advice; not the "own error" line, which the ranks
    # that stopped after it say better
    detail = [ln.split(": ", 1)[1] for ln in first.lines[1:]
              if ": " in ln and "this rank's own error" not in ln]
    line = (f"{prog}: error: rank {first.rank}/{first.world_size} stopped by {first.error} "
            f"({first.where})")
    if detail:
        line += "; " + "; ".join(detail)
    others = sorted(f.rank for f in failures[1:])
    if others:
        line += (f"; rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} "
                 f"stopped after it")
    return first.traceback, line

"""Running a benchmark's grid of training runs and keeping every finished run.

A quality grid (``bench_recall.py``, ``bench_lm.py``) takes hours on a few cores, is
stopped and resumed, and is run in parts at once. So each finished run is written as it
arrives, under a file lock, merged with what other processes stored meanwhile, and
replaced atomically: a grid that is stopped, or two parts writing one file, lose nothing.
"""

from __future__ import annotations

import fcntl
import json
import multiprocessing
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

Run = dict[str, Any]


def run_parallel(job: Callable[[Run], Run], jobs: list[Run], workers: int,
                 report: Callable[[Run], None], spawn: bool = False) -> None:
    """Run ``job(kw)`` for each ``kw`` in ``jobs`` (in ``workers`` processes when more
    than one is asked for and there is more than one job) and hand each result to
    ``report`` as it finishes. ``job`` must be a module-level function (it is pickled).
    ``spawn``: start the workers as fresh interpreters (needed for CUDA)."""
    if workers > 1 and len(jobs) > 1:
        ctx = multiprocessing.get_context("spawn") if spawn else None
        with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            for fut in as_completed([pool.submit(job, kw) for kw in jobs]):
                report(fut.result())
    else:
        for kw in jobs:
            report(job(kw))


def save_merged(path: Path, results: list[Run], key: Callable[[Run], tuple],
                load: Callable[[Path], Iterable[Run]],
                make_data: Callable[[list[Run]], dict[str, Any]]) -> None:
    """Store ``make_data(results)`` as JSON in ``path``.

    Under an exclusive lock on ``path``'s ``.lock`` file, first make ``results`` (in place)
    one run per ``key``: its own runs, the first of each key, then the runs that
    ``load(path)`` finds with keys it lacks, so runs that another process stored meanwhile
    are kept and a run two parts both did counts once. Then write to a temporary file and
    rename it over ``path``, so a reader never sees half a file."""
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stored = load(path) if path.exists() else []
        unique: dict[tuple, Run] = {}
        for r in (*results, *stored):
            unique.setdefault(key(r), r)
        results[:] = unique.values()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(make_data(results), indent=1))
        tmp.replace(path)

"""Run the trainer under torchrun on this machine and read back its JSONL (tests, benchmarks).

:func:`run_local` is one torchrun "node"; :func:`torchrun_argv` and :func:`worker_env`
are its command and environment, from which the multi-node test starts several that meet
at a c10d rendezvous.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LocalRun:
    """What a finished launch left behind."""

    returncode: int
    output: str  # stdout and stderr, interleaved
    seconds: float
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]


def read_jsonl(path: str, events: bool = False) -> list[dict[str, Any]]:
    """The lines of a trainer JSONL in order; without ``events`` the start markers
    (``{"event": "start"}``) are left out, so that only iteration records remain."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows if events else [r for r in rows if "event" not in r]


def worker_env(extra: dict[str, str] | None) -> dict[str, str]:
    """This environment for a torchrun worker: one OpenMP thread, unbuffered output,
    then ``extra``, then hla-sp train's allocator policy unless those chose one."""
    from hla_sp.launch.distributed.allocator import set_worker_allocator

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    set_worker_allocator(env)
    return env


def torchrun_argv(nproc: int, flags: list[str], rdzv: list[str] | None = None) -> list[str]:
    base = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    # --monitor-interval: notice a dead worker quickly (the default polls every 0.1-5 s)
    base += rdzv if rdzv is not None else ["--standalone"]
    return [*base, "--max-restarts", "0", "--monitor-interval", "0.2", "-m",
            "hla_sp.launch.train", *flags]  # fmt: skip


def run_local(
    flags: list[str],
    nproc: int,
    jsonl: str,
    *,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> LocalRun:
    """``torchrun --standalone --nproc-per-node NPROC -m hla_sp.launch.train FLAGS``."""
    if os.path.exists(jsonl):
        os.remove(jsonl)
    t0 = time.perf_counter()
    p = subprocess.run(
        torchrun_argv(nproc, [*flags, "--log-jsonl", jsonl]),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        env=worker_env(env),
    )
    return LocalRun(p.returncode, p.stdout, time.perf_counter() - t0, read_jsonl(jsonl))

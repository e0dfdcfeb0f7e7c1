"""Progress lines (rank 0), JSONL records, and peak memory per rank."""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any, TextIO

import torch


def peak_memory_bytes() -> int:
    """Peak memory of this process: CUDA's allocator peak on GPU, peak RSS on CPU.

    On CPU the figure includes the interpreter, torch and megatron (several hundred
    MiB); compare runs against each other, not against tensor sizes alone.
    """
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    # ru_maxrss is KiB on Linux
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def current_rss_bytes() -> int:
    """Resident memory now (Linux /proc), 0 where unavailable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def progress_line(rec: dict[str, Any], train_iters: int) -> str:
    """One human line per logged iteration."""
    return (
        f"iter {rec['iteration']:>5}/{train_iters} | loss {rec['loss']:.4f} | "
        f"lr {rec['lr']:.2e} | grad-norm {rec['grad_norm']:.3f} | "
        f"{rec['tokens_per_s']:,.0f} tok/s | step {rec['step_time_s']:.2f} s | "
        f"peak mem {gib(rec['peak_mem_bytes'])} "
        f"(max of {len(rec['peak_mem_bytes_per_rank'])} ranks)"
    )


class JsonlLog:
    """Appends one JSON object per line and flushes, so a crash loses at most one line."""

    def __init__(self, path: str | None):
        self._f: TextIO | None = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._f = open(path, "a")  # noqa: SIM115 -- lives as long as the run

    def write(self, rec: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps(rec) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def say(msg: str, stream: TextIO = sys.stdout) -> None:
    """Print and flush (torchrun pipes stdout; unflushed lines vanish on a crash)."""
    print(msg, file=stream, flush=True)

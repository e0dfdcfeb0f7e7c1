"""glibc's allocator settings for timing runs on CPU.

With glibc's defaults, freed blocks over its adaptive mmap threshold (at most 32 MiB)
go back to the OS, so a call whose tensors are that large page-faults them in again on
every repetition, while smaller tensors reuse heap pages: the time of a call then
depends on its sizes in a way that no kernel does. Timing runs therefore keep freed
memory in the heap. glibc reads these settings at start-up only, so a script that
wants them runs itself again with them set.
"""

from __future__ import annotations

import os
import sys

# no mmap-ed blocks, no trimming of the heap's top
KEEP_FREED = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}


def keeping_freed() -> bool:
    """Whether this process runs with :data:`KEEP_FREED`."""
    return all(os.environ.get(k) == v for k, v in KEEP_FREED.items())


def rerun_keeping_freed(script: str, argv: list[str]) -> None:
    """Replace this process by ``script argv`` with :data:`KEEP_FREED` set (no return),
    unless it already runs with them (then return)."""
    if keeping_freed():
        return
    os.execve(sys.executable, [sys.executable, os.path.abspath(script), *argv],
              {**os.environ, **KEEP_FREED})

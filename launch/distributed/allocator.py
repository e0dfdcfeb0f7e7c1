"""The CPU allocator policy of the launcher's workers: glibc's thresholds, fixed high.

A training step frees and reallocates the same few hundred tensors every iteration.
With glibc's defaults, blocks above its mmap threshold are mmap-ed on allocation and
returned on free (and the heap's top is trimmed past 128 KiB), so every step faults
its activations in again, page by page: in the issue's measurement of ``make
demo-python`` the kernel's time equalled the math's (sys 43 s of 99 s, 11.8 M minor
faults in 40 iterations). With both thresholds at 1 GiB, freed blocks below that stay
in the heap and are reused by the next step (sys 4 s, 0.35 M faults, the same losses
bit for bit: the allocator changes where a tensor lives, never what is computed).
Fixing the thresholds also turns off glibc's dynamic threshold, whose growth after
large frees made memory creep (the earlier policy's reason, a 128 KiB threshold): the
heap grows to a step's working set and is reused from then on.

glibc's own settings rather than jemalloc or tcmalloc: they need no package and no
``LD_PRELOAD`` (which every child process, compilers included, would inherit), work
wherever glibc does, and remove the churn measured. A user who sets any of glibc's
malloc variables, malloc tunables in ``GLIBC_TUNABLES``, or preloads another allocator,
keeps their own setting whole: nothing here is added to it.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# 1 GiB: above the tensors of the documented CPU runs, so none of them is mmap-ed
THRESHOLD = str(1 << 30)
POLICY = {"MALLOC_MMAP_THRESHOLD_": THRESHOLD, "MALLOC_TRIM_THRESHOLD_": THRESHOLD}
# the allocator is the user's once any of these says something about it
_GLIBC_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_",
               "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST")
_PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")


def users_allocator(environ: MutableMapping[str, str]) -> str | None:
    """What in ``environ`` shows the user chose the allocator (None: nothing)."""
    for name in _GLIBC_VARS:
        if name in environ:
            return name
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    if any(a in environ.get("LD_PRELOAD", "") for a in _PRELOADED):
        return "LD_PRELOAD"
    return None


def set_worker_allocator(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Add :data:`POLICY` to ``environ`` (default: this process's, which the workers
    inherit) unless the user chose the allocator; returns what was added."""
    env = os.environ if environ is None else environ
    if users_allocator(env) is not None:
        return {}
    env.update(POLICY)
    return dict(POLICY)

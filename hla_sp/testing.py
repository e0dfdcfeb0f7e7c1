"""A reusable pool of gloo ranks for multi-process tests and benchmarks on CPU.

Spawning a world costs seconds, so a :class:`World` starts P processes once, joins
them in a gloo process group through a file:// rendezvous (no fixed port), and then
runs any number of tasks on all ranks. A task is a picklable module-level function
``fn(rank, world_size, *args)``; :meth:`World.run` returns the per-rank results and
raises, with the remote traceback, if any rank raised. A task that does not finish
within its timeout kills the world (its group may be wedged) so that the next
:meth:`World.run` starts a fresh one.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class RemoteError(RuntimeError):
    """A task raised on one or more ranks; the message holds each rank's traceback."""

    def __init__(self, errors: dict[int, tuple[str, str]]):
        self.errors = errors  # rank -> (exception type name, traceback text)
        text = "\n".join(f"--- rank {r}: {t}\n{tb}" for r, (t, tb) in sorted(errors.items()))
        super().__init__(f"task failed on ranks {sorted(errors)}:\n{text}")


class WorldTimeout(TimeoutError):
    """A task did not finish on every rank in time; the world was torn down."""


def _worker(rank: int, world_size: int, init_file: str, tasks: Any, results: Any) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        while True:
            item = tasks.get()
            if item is None:
                break
            fn, args = item
            try:
                value = fn(rank, world_size, *args)
                # Pickle here: a queue pickles in a background thread, where a failure
                # would be lost and the caller would wait for its whole timeout.
                results.put((rank, True, pickle.dumps(value)))
            except BaseException as e:  # report, keep serving
                results.put((rank, False, (type(e).__name__, traceback.format_exc())))
    finally:
        dist.destroy_process_group()


class World:
    """P gloo ranks kept alive across tasks.

    >>> with World(2) as w:
    ...     w.run(some_module_level_fn, arg)   # -> [result_rank0, result_rank1]
    """

    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size: expected >= 1, got {world_size}")
        self.world_size = world_size
        self._procs: list[mp.process.BaseProcess] = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="hla_sp_world_")
        init_file = os.path.join(self._dir.name, "rendezvous")
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, init_file, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank; return results by rank."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for q in self._tasks:
            q.put((fn, args))
        out: dict[int, Any] = {}
        errors: dict[int, tuple[str, str]] = {}
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._results.get(timeout=timeout)
            except queue.Empty:
                self.close()
                raise WorldTimeout(
                    f"{getattr(fn, '__name__', fn)} did not finish on ranks "
                    f"{sorted(set(range(self.world_size)) - set(out) - set(errors))} "
                    f"within {timeout} s; the world was torn down"
                ) from None
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors[rank] = value
        if errors:
            raise RemoteError(errors)
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop every rank (politely, then by force)."""
        if not self._procs:
            return
        for q in self._tasks:
            with contextlib.suppress(OSError, ValueError):
                q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
        self._dir.cleanup()

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""What every exchange shares: byte and wait accounting, exchanges in flight, the
tensor forms of the collectives.

Bytes sent by this rank are counted per category (see :func:`traffic`), as the
bandwidth-optimal ring algorithm of each collective sends them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

_TRAFFIC: dict[str, int] = {}
_BLOCKED = [0.0]  # seconds the calling thread waited for forward exchanges to finish
_LOCK = threading.Lock()


def count(category: str, nbytes: int) -> None:
    """Add ``nbytes`` sent by this rank to ``category``."""
    with _LOCK:
        _TRAFFIC[category] = _TRAFFIC.get(category, 0) + int(nbytes)


def traffic() -> dict[str, int]:
    """Bytes sent by this rank since the last reset, per category and in ``total``.

    Categories: ``summary`` (forward exchange), ``summary_grad`` (its backward),
    ``final`` / ``final_grad`` (final states), ``meta`` (the per-call agreement check).
    """
    with _LOCK:
        out = dict(_TRAFFIC)
    out["total"] = sum(out.values())
    return out


def reset_traffic() -> None:
    """Zero every counter (bytes and blocked time)."""
    with _LOCK:
        _TRAFFIC.clear()
        _BLOCKED[0] = 0.0


def blocked_seconds() -> float:
    """Seconds this rank's calling thread has waited for forward exchanges since the
    last reset: what the overlap did not hide (includes waiting for slower ranks)."""
    return _BLOCKED[0]


# torch >= 2.10 renamed the tensor forms of the two collectives; keep older torch working.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


def gathered(x: torch.Tensor, group: dist.ProcessGroup, P: int) -> torch.Tensor:
    """Every rank's ``x``, [P, *x.shape], as one functional all-gather: the form that
    torch.compile traces (the eager paths use the asynchronous collectives above, in
    their own autograd Functions). Differentiable: autograd's reverse is a
    reduce-scatter, the sum over ranks of what each rank read from this rank's ``x``.
    Its bytes are not counted (:func:`traffic` counts the eager paths)."""
    if P == 1:
        return x[None]
    from torch.distributed._functional_collectives import all_gather_tensor_autograd

    flat = x.contiguous().reshape(-1)
    return all_gather_tensor_autograd(flat, 0, group).view(P, *x.shape)


def size_bytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


class Pending:
    """An exchange in flight; :meth:`wait` returns its result."""

    def __init__(self, wait: Callable[[], Any]):
        self._wait = wait

    def wait(self) -> Any:
        t = time.perf_counter()
        try:
            return self._wait()
        finally:
            _BLOCKED[0] += time.perf_counter() - t


def on_thread(fn: Callable[[], Any]) -> Pending:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:  # re-raised on the calling thread
            box["err"] = e

    t = threading.Thread(target=run, name="hla_sp-exchange", daemon=True)
    t.start()

    def wait() -> Any:
        t.join()
        if "err" in box:
            raise box["err"]
        return box["out"]

    return Pending(wait)

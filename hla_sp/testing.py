"""Shared test tooling: rounding-error bounds, and a pool of gloo ranks.

**Rounding-error bounds.** A low-precision result is checked against an fp64
reference with a bound from the condition of the computation, never from one
machine's own result: a value computed as a sum of products, each term passing
through at most ``n`` roundings of unit roundoff ``u``, errs by at most
``n * u * M`` (Higham's gamma_n, first order), where ``M`` is the sum of the
magnitudes of its terms, which is the same computation evaluated in fp64 on the
absolute values of the inputs (decay weights are positive already). The bound holds
for every summation order, blocking, FMA use and thread count, so it holds on any
machine. :func:`rounding_bound` and :func:`assert_within_rounding` implement it;
:func:`decay_grad_magnitude` gives ``M`` for a log-decay gradient.

**Worlds.** A reusable pool of gloo ranks for multi-process tests and benchmarks on CPU.

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
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-p of a floating dtype (half its machine epsilon): 2^-24 for fp32."""
    return torch.finfo(dtype).eps / 2


def rounding_bound(
    magnitude: torch.Tensor, roundings: Mapping[torch.dtype, int]
) -> torch.Tensor:
    """Elementwise worst-case rounding error: ``sum_d n_d u_d * magnitude``.

    ``magnitude`` is the fp64 sum of the magnitudes of each value's terms (the
    computation on absolute values); ``roundings`` maps each working dtype to the
    most roundings in it along one term's path (inputs cast to it included).
    """
    per_unit = sum(n * unit_roundoff(dt) for dt, n in roundings.items())
    return magnitude.detach().double().abs() * per_unit


def assert_within_rounding(
    name: str,
    got: torch.Tensor,
    ref: torch.Tensor,
    magnitude: torch.Tensor,
    roundings: Mapping[torch.dtype, int],
) -> float:
    """Assert |got - ref| <= :func:`rounding_bound` elementwise; return the worst
    ratio error / bound (how much of the bound was used).

    The fp64 reference's own error is far below the bound; a floor of the smallest
    normal fp64 only keeps exact zeros (magnitude 0) from dividing by zero.
    """
    got, ref = got.detach().double(), ref.detach().double()
    if got.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)}, reference {tuple(ref.shape)}")
    bound = rounding_bound(magnitude, roundings).expand_as(ref)
    bound = bound + torch.finfo(torch.float64).tiny
    err = (got - ref).abs()
    ratio = err / bound
    worst = int(ratio.flatten().argmax()) if ratio.numel() else 0
    r = ratio.flatten()[worst].item() if ratio.numel() else 0.0
    assert r <= 1.0 and bool(torch.isfinite(got).all()), (
        f"{name}: error {err.flatten()[worst].item():.3e} at flat index {worst} exceeds the "
        f"rounding bound {bound.flatten()[worst].item():.3e} ({dict(roundings)} roundings "
        f"of magnitude {magnitude.expand_as(ref).flatten()[worst].item():.3e}); ratio {r:.3g}"
    )
    return r


def assert_within_reference_error(
    name: str, got: torch.Tensor, low: torch.Tensor, exact: torch.Tensor, factor: float = 2.0
) -> float:
    """Flash-attention's rule for a low-precision path: max |got - exact| <= factor *
    max |low - exact|, where ``low`` is a reference computed at the same precision (the
    naive form in bf16) and ``exact`` the fp64 one. Returns the ratio of the two errors.

    The floor (one rounding of the largest |exact|) only matters when the reference
    happens to be exact, which a bf16 computation of any size is not.
    """
    got, low, exact = (x.detach().double() for x in (got, low, exact))
    if not got.shape == low.shape == exact.shape:
        raise AssertionError(f"{name}: shapes {tuple(got.shape)}, {tuple(low.shape)}, "
                             f"{tuple(exact.shape)}")
    err = (got - exact).abs().max().item()
    ref_err = (low - exact).abs().max().item()
    floor = unit_roundoff(torch.bfloat16) * exact.abs().max().item()
    ok = bool(torch.isfinite(got).all()) and err <= factor * ref_err + floor
    assert ok, (f"{name}: error {err:.3e} against fp64 exceeds {factor} x the error "
                f"{ref_err:.3e} of the reference at the same precision")
    return err / max(ref_err, floor)


def decay_grad_magnitude(
    loss_terms: torch.Tensor, shape: tuple[int, ...], T: int, stages: int = 1
) -> torch.Tensor:
    """Magnitude ``M`` for the gradient of a loss with respect to a log-decay.

    The gradient at token u is a sum over the loss's terms whose decay interval
    contains u; every method computes it from cumulative sums of (q . dq - k . dk)
    that cancel, and each such partial sum is bounded by twice the sum of the
    magnitudes of all the loss's terms on that (batch row, head), per stage.

    Args:
        loss_terms: [B, H], the loss on absolute values per batch row (or document
            sequence) and head, e.g. ``(o_abs * do.abs()).sum((1, 3))`` plus the
            final-state terms.
        shape: the log-decay's shape: [B, T, H] (per token) or [H] (a per-head
            constant, whose gradient sums T tokens of every row).
    """
    per_token = 2.0 * stages * loss_terms.detach().double()
    if len(shape) == 1:
        return T * per_token.sum(0)
    return per_token[:, None, :].expand(shape[0], T, shape[-1])


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


# Collectives and host reads that :func:`counting` counts, by the name they are counted
# under; the tensor forms of the collectives are also bound under other names in
# hla_sp.parallel's modules (patched there too).
_DIST_CALLS = {
    "all_gather": ("all_gather_into_tensor", "all_gather_single", "all_gather"),
    "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter"),
    "all_reduce": ("all_reduce",),
    "send": ("isend", "send"),
    "recv": ("irecv", "recv"),
    "broadcast": ("broadcast",),
}
_HOST_READS = ("item", "tolist", "cpu")


@contextlib.contextmanager
def counting() -> Any:
    """Count torch.distributed collectives and host reads (``Tensor.item``, ``tolist``,
    ``cpu``) made in this process inside the block; yields the live dict name -> count.

    Every module of :mod:`hla_sp.parallel` that bound a collective under its own name
    is patched too, so a call counts once whatever name it is made through. Calls on
    helper threads (ring, tree) are counted as well.
    """
    import importlib
    import threading

    counts: dict[str, int] = {}
    lock = threading.Lock()
    patched: list[tuple[object, str, object]] = []

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*a: Any, **kw: Any) -> Any:
            with lock:
                counts[name] = counts.get(name, 0) + 1
            return fn(*a, **kw)

        counted._hla_counted = True  # type: ignore[attr-defined]
        return counted

    def patch(owner: object, attr: str, name: str) -> None:
        fn = getattr(owner, attr, None)
        if fn is None or getattr(fn, "_hla_counted", False):
            return
        patched.append((owner, attr, fn))
        setattr(owner, attr, wrap(name, fn))

    modules = [dist]
    for m in ("comm", "exchange", "halo", "agreement", "p2p", "config", "primitive"):
        with contextlib.suppress(ImportError):
            modules.append(importlib.import_module(f"hla_sp.parallel.{m}"))
    originals = {id(getattr(dist, a, None)): n for n, attrs in _DIST_CALLS.items()
                 for a in attrs if getattr(dist, a, None) is not None}
    for mod in modules:
        for attr, value in list(vars(mod).items()):
            if callable(value) and id(value) in originals:
                patch(mod, attr, originals[id(value)])
    for attr in _HOST_READS:
        patch(torch.Tensor, attr, attr)
    try:
        yield counts
    finally:
        for owner, attr, fn in reversed(patched):
            setattr(owner, attr, fn)

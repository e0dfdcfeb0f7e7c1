"""Shared tasks of the sequence-parallel benchmarks (CPU, gloo, hla_sp.testing.World).

Each task is a module-level function ``fn(rank, world_size, ...)`` run on every rank;
the bench_sp_*.py scripts start worlds, run these tasks and write JSON + PNG into
``--out`` (default ``runs/bench/``; ``--out benchmarks/results`` refreshes the
committed figures that docs/parallel.md cites).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import hla_sp
from hla_sp.parallel import SequenceParallel, reset_traffic, shard, traffic
from hla_sp.parallel.comm import blocked_seconds

COMMITTED = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "runs" / "bench"


def results_dir(argv: list[str] | None = None) -> Path:
    """``--out DIR`` of the script's command line, else runs/bench: a run replaces the
    committed figures in benchmarks/results only when asked to."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return ap.parse_known_args(sys.argv[1:] if argv is None else argv)[0].out


# The bench_sp_* scripts take no other flags; their output folder is read once, here.
RESULTS = results_dir()


def save(name: str, data: dict[str, Any]) -> Path:
    """Write RESULTS/<name>.json (``--out``) and return its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {"python": sys.version.split()[0], "torch": torch.__version__, **data}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def global_inputs(T: int, H: int, K: int, V: int, seed: int = 0, decay: float = 0.02):
    """Seeded global q, k, v [1, T, H, *] and a per-head log-decay [H] (same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, T, H, d, generator=gen) for d in (K, K, V))
    g = -decay * (1 + torch.rand(H, generator=gen))
    return q, k, v, g


def _layer(q, k, v, g, sp, normalize=False):
    o, _ = hla_sp.hla2(q, k, v, log_decay=g, sp=sp, normalize=normalize)
    return o


def _fwd_bwd(q, k, v, g, sp, w) -> None:
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    o = _layer(*leaves, g, sp)
    (o * w).sum().backward()


def traffic_task(rank: int, P: int, T: int, H: int, K: int, V: int, method: str,
                 layout: str) -> dict[str, int]:
    """Bytes this rank sends for one hla2 layer, forward + backward."""
    q, k, v, g = global_inputs(T, H, K, V)
    q, k, v = (shard(x, rank, P, layout) for x in (q, k, v))
    sp = SequenceParallel(layout=layout, method=method)
    reset_traffic()
    _fwd_bwd(q, k, v, g, sp, torch.ones(1, q.shape[1], H, V))
    return traffic()


def _barrier_time(fn) -> float:
    """Wall time of ``fn`` on this rank, between two barriers."""
    dist.barrier()
    t = time.perf_counter()
    fn()
    dt = time.perf_counter() - t
    dist.barrier()
    return dt


def timing_task(rank: int, P: int, T_local: int, H: int, K: int, V: int,
                methods: list[str], reps: int) -> dict[str, Any]:
    """Per method: sharded hla2 time vs the single-rank time on the same T/P tokens.

    The single-rank baseline runs on every rank at the same moment, so it meets the
    same CPU contention as the sharded call, and all configurations are interleaved
    rep by rep so that drifting load hits them alike. Forward-only times are taken
    with and without overlap, and the exchange alone on the same summaries.
    Returns, per configuration, the list of this rank's times.
    """
    T = T_local * P
    q, k, v, g = global_inputs(T, H, K, V)
    q, k, v = (shard(x, rank, P) for x in (q, k, v))
    w = torch.randn(1, T_local, H, V)

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    configs = {
        "local/fwd": no_grad(lambda: _layer(q, k, v, g, None)),
        "local/fwd_bwd": lambda: _fwd_bwd(q, k, v, g, None, w),
    }
    for method in methods:
        sp = SequenceParallel(method=method)
        configs[f"{method}/fwd_bwd"] = lambda sp=sp: _fwd_bwd(q, k, v, g, sp, w)
        configs[f"{method}/fwd"] = no_grad(lambda sp=sp: _layer(q, k, v, g, sp))
        waits = SequenceParallel(method=method, overlap=False)  # exchange, then local work
        configs[f"{method}/fwd_no_overlap"] = no_grad(lambda sp=waits: _layer(q, k, v, g, sp))
        # backward too: without overlap the reverse exchange is waited for at once
        configs[f"{method}/fwd_bwd_no_overlap"] = lambda sp=waits: _fwd_bwd(q, k, v, g, sp, w)
        configs[f"{method}/exchange_alone"] = no_grad(lambda sp=sp: _exchange_only(sp, q, k, v))
    times: dict[str, list[float]] = {name: [] for name in configs}
    for fn in configs.values():  # warm-up
        fn()
    for _ in range(reps):
        for name, fn in configs.items():
            reset_traffic()
            times[name].append(_barrier_time(fn))
            if name.endswith(("/fwd", "/fwd_no_overlap")) and not name.startswith("local"):
                # Time this rank sat in the exchange's wait: what the overlap did not hide.
                times.setdefault(f"{name}/blocked", []).append(blocked_seconds())
    return times


def _exchange_only(sp: SequenceParallel, q, k, v) -> None:
    """The two summary exchanges of an hla2 forward, with no local work between."""
    from hla_sp.ops.validate import check_inputs
    from hla_sp.parallel import exchange
    from hla_sp.parallel import summaries as S

    x = check_inputs(q, k, v, log_decay=None, scale=None, cu_seqlens=None, sp=sp, chunk_size=64)
    plan = sp.check_call(x, op="hla2", options=dict(normalize=False, ridge=0.0, eps=1e-6))
    B, _, H, K = q.shape
    for Vd in (K, v.shape[-1]):
        shape = S.SummaryShape(B, H, K, Vd)
        X = torch.zeros(len(plan.own), shape.size)
        exchange.start(sp.method, plan, shape, X).wait()


def maxrss_mib() -> float:
    """Peak resident set size of this process so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_task(rank: int, P: int, T_local: int, H: int, K: int, V: int,
                sharded: bool) -> dict[str, float]:
    """Peak RSS growth of one hla2 fwd+bwd on this rank (run in a fresh world)."""
    T = T_local * P
    sp = SequenceParallel() if sharded else None
    q0, k0, v0, g = global_inputs(64 * P, H, K, V)  # warm-up: load kernels and libraries
    _fwd_bwd(*(shard(x, rank, P) for x in (q0, k0, v0)), g, sp, 1.0)
    q, k, v, g = global_inputs(T, H, K, V)
    if sharded:
        q, k, v = (shard(x, rank, P).clone() for x in (q, k, v))
    before = maxrss_mib()
    _fwd_bwd(q, k, v, g, sp, 1.0)
    return {"before_mib": before, "peak_mib": maxrss_mib(), "tokens": q.shape[1]}


def million_task(rank: int, P: int, T: int, H: int, K: int, V: int, chunk: int) -> dict:
    """One hla2 layer fwd+bwd over P ranks; returns this rank's outputs, grads, time, RSS."""
    q, k, v, g = global_inputs(T, H, K, V)
    w = torch.randn(1, T, H, V, generator=torch.Generator().manual_seed(1))
    q, k, v, w = (shard(x, rank, P).clone() for x in (q, k, v, w))
    sp = SequenceParallel()
    before = maxrss_mib()
    leaves = [x.requires_grad_(True) for x in (q, k, v)]
    dist.barrier()
    t = time.perf_counter()
    o, _ = hla_sp.hla2(*leaves, log_decay=g, sp=sp, chunk_size=chunk)
    t_fwd = time.perf_counter() - t
    (o * w).sum().backward()
    dt = time.perf_counter() - t
    return {"time_s": dt, "fwd_s": t_fwd, "rss_before_mib": before, "rss_peak_mib": maxrss_mib(),
            "o": o.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}

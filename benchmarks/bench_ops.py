"""Operator benchmark on CPU: hla2 against causal SDPA, linear_attention and the recurrence.

fp32, forward + backward, B=1, H=4, K=V=64, T from 1k to 64k. Writes ``ops.json`` and
``ops.png`` to ``--out``: ``runs/bench`` by default, ``benchmarks/results`` for the
committed figures (docs/benchmarks.md gives each command's duration).

    python benchmarks/bench_ops.py            # the full run, with the 16k profile
    python benchmarks/bench_ops.py --quick    # small T, a smoke test

Timing: every (op, T) point is repeated and the median is reported. The ops of one T
are run round-robin, so a burst of load from other processes on a shared machine
falls on all of them alike; the ratios are also taken per round (adjacent in time)
and their median reported. Quadratic SDPA and the serial recurrence stop at
``--sdpa-max-t`` / ``--recurrent-max-t``; points past that are recorded as
``"not run"``, never extrapolated.

Allocator: glibc hands every freed block over its (adaptive, at most 32 MiB) mmap
threshold back to the OS, so at 64k (64 MiB tensors) every call page-faults its
outputs afresh while at 16k (16 MiB) it reuses heap pages: that alone made the
16k -> 64k growth 5.3x instead of 4.2x for the primitive's forward (measured with
``MALLOC_MMAP_MAX_=0``, which keeps freed memory in the heap). The timing process
therefore re-runs itself with freed memory kept (``--allocator keep``, the default:
``MALLOC_MMAP_MAX_=0``, ``MALLOC_TRIM_THRESHOLD_`` = 1 TiB), so that every T is timed
in the same regime; ``--allocator default`` times glibc's defaults. The memory
subprocesses always run with glibc's defaults.

Memory: see :func:`measure_memory`. Targets are reported, never asserted; the FLOP
counts, fits, ratios, targets and the plot are in ``bench_ops_analysis.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from allocator import KEEP_FREED, keeping_freed, rerun_keeping_freed
from bench_ops_analysis import (
    CHUNK,
    NOT_RUN,
    OPS,
    B,
    H,
    K,
    V,
    analyse,
    flops,
    plot,
    set_fractions,
)

import hla_sp
from hla_sp.ops.reference import recurrent_hla2

FULL_TS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
QUICK_TS = [256, 512]
# runs/bench by default: only --out benchmarks/results replaces the committed figures
# that docs/benchmarks.md cites (--quick, a smoke test, must never do that by accident)
RESULTS = Path(__file__).resolve().parents[1] / "runs" / "bench"

Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def op_fn(name: str) -> Fn:
    """The forward of ``name`` on [B, T, H, D] inputs, returning the output only."""
    if name == "hla2":
        return lambda q, k, v: hla_sp.hla2(q, k, v)[0]
    if name == "linear_attention":
        return lambda q, k, v: hla_sp.linear_attention(q, k, v)[0]
    if name == "sdpa":
        # SDPA wants [B, H, T, D]; the transposes are views, as a model would pass them.
        return lambda q, k, v: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        ).transpose(1, 2)
    if name == "recurrent_hla2":
        return lambda q, k, v: recurrent_hla2(q, k, v)[0]
    raise ValueError(f"op: expected one of {OPS}, got {name!r}")


def make_inputs(T: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v [B, T, H, D] fp32 leaves that require grad."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, T, H, K), (B, T, H, K), (B, T, H, V)]
    return tuple(torch.randn(s, generator=gen).requires_grad_() for s in shapes)


def fwd_bwd(fn: Fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[float, float]:
    """One forward + backward; returns (forward seconds, total seconds)."""
    for x in (q, k, v):
        x.grad = None
    t0 = time.perf_counter()
    o = fn(q, k, v)
    t1 = time.perf_counter()
    # A fixed random cotangent would cost a T-sized tensor; sum() gives ones, which
    # exercises the same backward graph.
    o.sum().backward()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t0


def matmul_gflops(reps: int) -> dict[str, float]:
    """This machine's torch.matmul GFLOP/s in fp32, measured now (median of ``reps``).

    ``square``: one 2048^3 product, the machine's practical peak, used as the
    reference for the fractions. ``chunk_batched``: the batched 64 x 64 x 64 products
    the chunk path is made of, to show what that shape allows.
    """
    out = {}
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    xa, xb = torch.randn(4 * 256, 64, 64), torch.randn(4 * 256, 64, 64)
    for name, (x, y) in {"square": (a, b), "chunk_batched": (xa, xb)}.items():
        m, kk, n = x.shape[-2], x.shape[-1], y.shape[-1]
        work = 2.0 * (x.numel() // (m * kk)) * m * kk * n
        torch.matmul(x, y)  # warm-up: MKL/oneDNN initialisation is not timed
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.matmul(x, y)
            ts.append(time.perf_counter() - t0)
        out[name] = work / statistics.median(ts) / 1e9
    return out


# --------------------------------------------------------------------------- memory


def _rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int:
    """Peak resident set size of this process's address space (VmHWM, Linux /proc).

    Not ru_maxrss: across fork + exec Linux carries the parent's high-water mark into
    the child's ru_maxrss, so a child started by a big parent would report the parent's
    peak. VmHWM belongs to the current address space and can be reset (clear_refs).
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("VmHWM not found in /proc/self/status")


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_child(op: str, T: int) -> dict[str, int | bool]:
    """Run in a fresh process: the peak RSS that one fwd+bwd of ``op`` adds over its inputs."""
    fn = op_fn(op)
    # Warm-up at a tiny T loads the kernels' code pages and thread pools, so that
    # what remains to be measured is the memory that scales with T.
    fwd_bwd(fn, *make_inputs(64))
    q, k, v = make_inputs(T)
    with contextlib.suppress(OSError, AttributeError):
        # Hand freed heap back to the OS, so that the baseline is what is really in use.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    reset = _reset_hwm()
    before = _rss_bytes()
    # Without a reset the high-water mark may already sit above the current RSS
    # (warm-up transients); the delta is then a lower bound. Recorded to be seen.
    stale = max(0, _hwm_bytes() - before)
    fwd_bwd(fn, q, k, v)
    return {"peak_extra_bytes": _hwm_bytes() - before, "stale_hiwater_bytes": stale,
            "hwm_reset": reset,
            "input_bytes": sum(x.numel() * x.element_size() for x in (q, k, v))}


def measure_memory(op: str, T: int) -> dict[str, int] | str:
    """Peak memory of one fwd+bwd of ``op`` at T, from a fresh subprocess.

    Why a subprocess and the RSS high-water mark: on CPU torch keeps no allocator
    statistics like torch.cuda.max_memory_allocated, and tensors come from glibc
    malloc (big ones mmap-ed and returned on free), so the kernel's resident-set
    high-water mark is the one peak that sees every allocation, including autograd's
    saved tensors and the temporaries inside MKL/oneDNN. Freed-but-kept heap from an
    earlier point would hide part of the next one, so each point runs in a fresh
    process; the baseline (RSS after imports, a warm-up and the inputs) is
    subtracted, leaving the memory that the computation adds.
    """
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", op, str(T)]
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    for name in KEEP_FREED:  # glibc's defaults: freed memory leaves the RSS
        env.pop(name, None)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode != 0:
        return f"failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}"
    return json.loads(r.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- profile


def profile_hla2(T: int, chunk_sizes: list[int], reps: int) -> dict:
    """Where hla2's time goes at T: top autograd/aten ops, and the chunk size's effect."""
    q, k, v = make_inputs(T)
    fn = op_fn("hla2")
    fwd_bwd(fn, q, k, v)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fwd_bwd(fn, q, k, v)
    top = [{"name": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6, "calls": e.count}
           for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]]
    sweep = {}
    for c in chunk_sizes:
        def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: int = c) -> torch.Tensor:
            return hla_sp.hla2(q, k, v, chunk_size=c)[0]

        ts = [fwd_bwd(f, q, k, v) for _ in range(reps)]
        sweep[str(c)] = {"fwd_s": statistics.median(t[0] for t in ts),
                         "time_s": statistics.median(t[1] for t in ts)}
    return {"T": T, "top_ops": top, "chunk_size_sweep": sweep}


# --------------------------------------------------------------------------- main


def _git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parent, timeout=10)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"small T set {QUICK_TS}, few repeats")
    p.add_argument("--ts", type=int, nargs="+", help="sequence lengths (overrides the set)")
    p.add_argument("--reps", type=int, default=None, help="timed repeats per point (T <= 16k)")
    p.add_argument("--reps-large", type=int, default=3, help="timed repeats per point (T > 16k)")
    p.add_argument("--sdpa-max-t", type=int, default=16384, help="largest T for causal SDPA")
    p.add_argument("--recurrent-max-t", type=int, default=1024,
                   help="largest T for the serial recurrence")
    p.add_argument("--no-memory", action="store_true", help="skip the memory subprocesses")
    p.add_argument("--mem-jobs", type=int, default=1,
                   help="memory subprocesses at once (after timing, so timing is not disturbed)")
    p.add_argument("--profile-t", type=int, default=None,
                   help="also profile hla2 at this T (default 16384; 0 = off; quick: off)")
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[32, 64, 128],
                   help="chunk sizes for the profile's sweep")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=RESULTS,
                   help="folder for ops.json and ops.png (default runs/bench; "
                   "benchmarks/results holds the committed figures)")
    p.add_argument("--reanalyse", type=Path, default=None,
                   help="recompute the analysis and plot of an existing ops.json, no timing")
    p.add_argument("--allocator", choices=["keep", "default"], default="keep",
                   help="time with freed memory kept in the heap (keep) or glibc's defaults")
    p.add_argument("--memory-child", nargs=2, metavar=("OP", "T"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.allocator == "keep" and not args.memory_child and not args.reanalyse:
        rerun_keeping_freed(__file__, sys.argv[1:] if argv is None else argv)
    keep = keeping_freed()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child[0], int(args.memory_child[1]))))
        return 0

    if args.reanalyse:
        res = json.loads(args.reanalyse.read_text())
        set_fractions(res)
        res["analysis"] = analyse(res)
        args.reanalyse.write_text(json.dumps(res, indent=1) + "\n")
        plot(res, args.reanalyse.with_suffix(".png"))
        print(json.dumps(res["analysis"]["targets"], indent=1))
        return 0

    Ts = args.ts or (QUICK_TS if args.quick else FULL_TS)
    reps = args.reps or (2 if args.quick else 5)
    profile_t = args.profile_t if args.profile_t is not None else (0 if args.quick else 16384)
    max_t = {"sdpa": args.sdpa_max_t, "recurrent_hla2": args.recurrent_max_t}
    if args.quick:
        max_t["recurrent_hla2"] = min(max_t["recurrent_hla2"], Ts[0])

    res: dict = {
        "config": {"B": B, "H": H, "K": K, "V": V, "dtype": "float32", "chunk_size": CHUNK,
                   "pass": "forward+backward", "reps": reps, "reps_large": args.reps_large,
                   "sdpa_max_t": max_t["sdpa"], "recurrent_max_t": max_t["recurrent_hla2"],
                   "quick": args.quick, "statistic": "median",
                   "allocator": (f"keep: {KEEP_FREED}" if keep else "glibc defaults")},
        "machine": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                    "cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "processor": platform.processor(), "python": platform.python_version()},
        "git_commit": _git_commit(),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "Ts": Ts,
    }
    res["matmul_gflops_start"] = matmul_gflops(reps=5)
    print(f"torch.matmul fp32: {res['matmul_gflops_start']}", flush=True)

    fns = {op: op_fn(op) for op in OPS}
    for fn in fns.values():  # warm-up: library initialisation is not timed
        fwd_bwd(fn, *make_inputs(128))
    ops: dict[str, dict[str, dict]] = {op: {} for op in OPS}
    for T in Ts:
        run_ops = [op for op in OPS if max_t.get(op, T) >= T]
        for op in OPS:
            if op not in run_ops:
                ops[op][str(T)] = {"time_s": NOT_RUN, "reason": f"T > {op} max {max_t[op]}"}
        q, k, v = make_inputs(T)
        n = reps if T <= 16384 else args.reps_large
        samples: dict[str, list[tuple[float, float]]] = {op: [] for op in run_ops}
        for _ in range(n):
            for op in run_ops:  # round-robin, see the module docstring
                samples[op].append(fwd_bwd(fns[op], q, k, v))
        for op in run_ops:
            tot = [s[1] for s in samples[op]]
            med = statistics.median(tot)
            ops[op][str(T)] = {"time_s": med, "fwd_s": statistics.median(s[0] for s in samples[op]),
                               "min_s": min(tot), "samples_s": tot, "flops": flops(op, T),
                               "gflops": flops(op, T) / med / 1e9}
        print(f"T={T:6d} " + "  ".join(f"{op}={ops[op][str(T)]['time_s']:.4g}s"
                                        for op in run_ops), flush=True)
        del q, k, v
    res["matmul_gflops_end"] = matmul_gflops(reps=5)
    res["ops"] = ops
    set_fractions(res)

    if not args.no_memory:
        jobs = [(op, T) for T in Ts for op in OPS if max_t.get(op, T) >= T]
        with ThreadPoolExecutor(max_workers=max(1, args.mem_jobs)) as pool:
            mems = list(pool.map(lambda j: measure_memory(*j), jobs))
        for (op, T), m in zip(jobs, mems):
            if isinstance(m, dict):
                ops[op][str(T)].update(m)
            else:
                ops[op][str(T)]["peak_extra_bytes"] = m
        for op in OPS:
            for T in Ts:
                ops[op][str(T)].setdefault("peak_extra_bytes", NOT_RUN)
        print("memory (MiB): " + "  ".join(
            f"{op}@{T}={ops[op][str(T)]['peak_extra_bytes'] / 2**20:.0f}" for op, T in jobs
            if isinstance(ops[op][str(T)]["peak_extra_bytes"], int)), flush=True)

    if profile_t:
        res["profile_hla2"] = profile_hla2(profile_t, args.chunk_sizes, reps=max(1, min(3, reps)))

    res["analysis"] = analyse(res)
    res["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ops.json").write_text(json.dumps(res, indent=1) + "\n")
    plot(res, args.out / "ops.png")
    print(json.dumps(res["analysis"]["targets"], indent=1))
    print(f"wrote {args.out / 'ops.json'} and {args.out / 'ops.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

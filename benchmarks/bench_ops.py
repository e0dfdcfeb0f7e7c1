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

Memory: see :func:`measure_memory`. Targets are reported, never asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
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

import hla_sp
from hla_sp.ops.reference import recurrent_hla2

B, H, K, V = 1, 4, 64, 64
CHUNK = 64  # the operators' default chunk size, used for the FLOP count
FULL_TS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
QUICK_TS = [256, 512]
OPS = ["hla2", "linear_attention", "sdpa", "recurrent_hla2"]
NOT_RUN = "not run"
# runs/bench by default: only --out benchmarks/results replaces the committed figures
# that docs/benchmarks.md cites (--quick, a smoke test, must never do that by accident)
RESULTS = Path(__file__).resolve().parents[1] / "runs" / "bench"

# Targets of issue 2, reported against, never asserted.
TARGET_SPEEDUP_VS_SDPA_16K = 10.0
TARGET_MAX_RATIO_VS_LA = 2.2
TARGET_MAX_GROWTH_16K_64K = 4.4

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


# --------------------------------------------------------------------------- FLOPs


def flops_primitive_fwd(T: int, k_dim: int, v_dim: int, C: int = CHUNK) -> float:
    """Matmul FLOPs of one chunk-path primitive call, forward, all heads.

    Per chunk of C tokens: Q K^T (2 C C K), masked scores times V (2 C C V), the
    chunk summary K^T V (2 C K V) and the carry q h (2 C K V). The in-chunk mask is
    computed in full, so the C x C products are counted in full. Elementwise work
    (exp of the decay, masking) is not counted.
    """
    Tp = -(-T // C) * C  # the chunk path pads T up to a multiple of C
    return B * H * 2.0 * Tp * (C * (k_dim + v_dim) + 2 * k_dim * v_dim)


def flops(op: str, T: int) -> float:
    """Forward + backward FLOPs of ``op`` at length T (explicit count, see comments)."""
    if op == "linear_attention":
        # Backward of a matmul is two matmuls of the same size: fwd + bwd = 3 x fwd.
        return 3 * flops_primitive_fwd(T, K, V)
    if op == "hla2":
        # Two primitive calls: LA(q, k, k) (value width K), then LA(q, k~, v).
        return 3 * (flops_primitive_fwd(T, K, K) + flops_primitive_fwd(T, K, V))
    if op == "sdpa":
        # Causal: Q K^T and P V over the T(T+1)/2 kept pairs, 2 FLOPs per multiply-add.
        # A flash-style backward recomputes P and does dV, dP, dQ, dK: 5 products.
        pairs = T * (T + 1) / 2
        fwd = B * H * 2.0 * pairs * (K + V)
        return fwd + 2.5 * fwd
    if op == "recurrent_hla2":
        # Per token: S += k k^T (2K^2), S q (2K^2), H += k~ v^T (2KV), q^T H (2KV).
        return 3 * B * H * T * (4.0 * K * K + 4.0 * K * V)
    raise ValueError(f"op: expected one of {OPS}, got {op!r}")


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
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode != 0:
        return f"failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}"
    return json.loads(r.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- analysis


def fit_exponent(ts: list[int], ys: list[float]) -> float | None:
    """Least-squares slope of log y against log T (None with fewer than two points)."""
    if len(ts) < 2:
        return None
    lx = [math.log(t) for t in ts]
    ly = [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    den = sum((x - mx) ** 2 for x in lx)
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / den


def measured(points: dict[str, dict], key: str) -> tuple[list[int], list[float]]:
    """The (T, value) pairs of one op that were run, in T order."""
    ts = sorted(int(t) for t, p in points.items() if isinstance(p.get(key), (int, float)))
    return ts, [points[str(t)][key] for t in ts]


def growth(points: dict[str, dict], key: str, lo: int, hi: int) -> float | str:
    a, b = points.get(str(lo), {}).get(key), points.get(str(hi), {}).get(key)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return b / a
    return NOT_RUN


def analyse(res: dict) -> dict:
    """Exponents, growth factors, ratios and the targets, from the raw points."""
    ops = res["ops"]
    out: dict = {"time_exponent": {}, "time_exponent_upper": {}, "memory_exponent": {},
                 "growth_16k_to_64k": {}, "memory_growth_16k_to_64k": {}}
    for op, pts in ops.items():
        ts, ys = measured(pts, "time_s")
        out["time_exponent"][op] = fit_exponent(ts, ys)
        # Upper half of the range: small T is dominated by per-call overhead.
        upper = [(t, y) for t, y in zip(ts, ys) if t >= (ts[-1] // 8 if ts else 0)]
        out["time_exponent_upper"][op] = fit_exponent([t for t, _ in upper], [y for _, y in upper])
        mts, mys = measured(pts, "peak_extra_bytes")
        pos = [(t, y) for t, y in zip(mts, mys) if y > 0]
        out["memory_exponent"][op] = fit_exponent([t for t, _ in pos], [y for _, y in pos])
        out["growth_16k_to_64k"][op] = growth(pts, "time_s", 16384, 65536)
        out["memory_growth_16k_to_64k"][op] = growth(pts, "peak_extra_bytes", 16384, 65536)

    ratios: dict[str, dict[str, float | str]] = {}
    for other in ("sdpa", "linear_attention", "recurrent_hla2"):
        r = {}
        for t in res["Ts"]:
            a, b = ops["hla2"][str(t)], ops.get(other, {}).get(str(t), {})
            if isinstance(a.get("time_s"), float) and isinstance(b.get("time_s"), float):
                r[str(t)] = {"ratio_of_medians": a["time_s"] / b["time_s"],
                             "median_paired_ratio": statistics.median(
                                 x / y for x, y in zip(a["samples_s"], b["samples_s"]))}
            else:
                r[str(t)] = NOT_RUN
        ratios[f"hla2/{other}"] = r
    out["time_ratios"] = ratios

    def at(name: str, t: int) -> float | str:
        x = ratios[name].get(str(t), NOT_RUN)
        return x["ratio_of_medians"] if isinstance(x, dict) else NOT_RUN

    speedup = at("hla2/sdpa", 16384)
    speedup = 1 / speedup if isinstance(speedup, float) else NOT_RUN
    la_ratios = [x["ratio_of_medians"] for x in ratios["hla2/linear_attention"].values()
                 if isinstance(x, dict)]
    worst_la = max(la_ratios) if la_ratios else NOT_RUN
    g = out["growth_16k_to_64k"]["hla2"]
    mem_exp = out["memory_exponent"]["hla2"]
    out["targets"] = {
        "speedup_vs_sdpa_16k": {"value": speedup, "target": f">= {TARGET_SPEEDUP_VS_SDPA_16K}",
                                "met": _met(speedup, lambda x: x >= TARGET_SPEEDUP_VS_SDPA_16K)},
        "max_ratio_vs_linear_attention": {
            "value": worst_la, "target": f"<= {TARGET_MAX_RATIO_VS_LA}",
            "met": _met(worst_la, lambda x: x <= TARGET_MAX_RATIO_VS_LA)},
        "hla2_growth_16k_to_64k": {"value": g, "target": f"<= {TARGET_MAX_GROWTH_16K_64K}",
                                   "met": _met(g, lambda x: x <= TARGET_MAX_GROWTH_16K_64K)},
        # "Linear" read as a fitted log-log exponent within 1 +- 0.15.
        "hla2_memory_exponent": {"value": mem_exp, "target": "linear: 0.85 .. 1.15",
                                 "met": _met(mem_exp, lambda x: 0.85 <= x <= 1.15)},
    }
    return out


def _met(x: object, ok: Callable[[float], bool]) -> bool | str:
    return bool(ok(x)) if isinstance(x, float) else NOT_RUN


def set_fractions(res: dict) -> None:
    """GFLOP/s of every point as a fraction of the matmul reference.

    The reference is the better of the start and end measurements: other load can
    only slow a measurement down, so the faster one is closer to what the machine
    can do.
    """
    ref = max(res["matmul_gflops_start"]["square"], res["matmul_gflops_end"]["square"])
    res["matmul_gflops_reference"] = ref
    for pts in res["ops"].values():
        for p in pts.values():
            if "gflops" in p:
                p["fraction_of_matmul"] = p["gflops"] / ref


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


# --------------------------------------------------------------------------- plot


def plot(res: dict, path: Path) -> None:
    """Time against T (log-log) per op, and peak memory against T."""
    import matplotlib

    matplotlib.use("Agg")  # no display on CI machines
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for op, pts in res["ops"].items():
        ts, ys = measured(pts, "time_s")
        if ts:
            ax_t.plot(ts, ys, "o-", label=op)
        mts, mys = measured(pts, "peak_extra_bytes")
        if mts:
            ax_m.plot(mts, [y / 2**20 for y in mys], "o-", label=op)
    ts_all = res["Ts"]
    for ax, ylab, title in ((ax_t, "seconds (fwd+bwd, median)", "time"),
                            (ax_m, "MiB (peak RSS over inputs)", "peak memory")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ts_all, [f"{t // 1024}k" if t >= 1024 else str(t) for t in ts_all])
        ax.set_xlabel("T")
        ax.set_ylabel(ylab)
        ax.set_title(f"{title}: B={B} H={H} K=V={K}, fp32 CPU")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # the memory panel is empty with --no-memory
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for ops.json and ops.png (default runs/bench; "
                   "benchmarks/results holds the committed figures)")
    p.add_argument("--reanalyse", type=Path, default=None,
                   help="recompute the analysis and plot of an existing ops.json, no timing")
    p.add_argument("--memory-child", nargs=2, metavar=("OP", "T"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
                   "quick": args.quick, "statistic": "median"},
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

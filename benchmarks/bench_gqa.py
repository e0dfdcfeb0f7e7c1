"""What grouped keys (GQA) cost against one kv head per query head, CPU torch path.

hla2 with Hq = 8 query heads runs over Hkv = 8 / G kv heads for G = 1, 2, 4, 8, and
each call (forward + backward, fp32, B = 1, T = 4096, K = V = 64, chunk 64) is timed
against the same call on Hkv = 8 (G = 1): the ratio is what a group costs
relative to no group. Each call is timed in thread CPU time (one thread); the variants
alternate call by call, so that a slow spell of a shared machine (cache and memory
contention remain) falls on all of them; the median of the repetitions is reported,
with the machine's load average before and after (the ratios are what to compare; the
absolute times are only meaningful on an idle machine).

    python benchmarks/bench_gqa.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

import hla_sp

GROUPS = (1, 2, 4, 8)


def _inputs(T: int, Hq: int, G: int, K: int, seed: int) -> list[torch.Tensor]:
    """q [1, T, Hq, K], k, v [1, T, Hq / G, K], log-decay [1, T, Hq / G], all leaves."""
    gen = torch.Generator().manual_seed(seed)
    Hkv = Hq // G
    q = torch.randn(1, T, Hq, K, generator=gen)
    k = torch.randn(1, T, Hkv, K, generator=gen) / K**0.5
    v = torch.randn(1, T, Hkv, K, generator=gen)
    g = -torch.rand(1, T, Hkv, generator=gen) * 0.05
    return [x.requires_grad_() for x in (q, k, v, g)]


def _step(xs: list[torch.Tensor], chunk: int) -> float:
    """Seconds of one forward + backward of hla2 on ``xs``, in this thread's CPU time:
    with one intra-op thread the CPU autograd engine runs the backward in the calling
    thread too, and CPU time does not count the spells other processes hold the core."""
    q, k, v, g = xs
    t = time.thread_time()
    o, _ = hla_sp.hla2(q, k, v, log_decay=g, chunk_size=chunk)
    o.square().sum().backward()
    return time.thread_time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--K", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--label", default="", help="appended to the JSON's file name")
    args = ap.parse_args()
    for name in ("T", "K", "heads", "chunk", "reps", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name}: expected a positive integer, got {getattr(args, name)}")
    groups = [G for G in GROUPS if args.heads % G == 0]
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    inputs = {G: _inputs(args.T, args.heads, G, args.K, seed=G) for G in groups}
    for G in groups:  # warm-up: allocations, first-call dispatch
        _step(inputs[G], args.chunk)
    times: dict[int, list[float]] = {G: [] for G in groups}
    for _ in range(args.reps):
        for G in groups:
            for x in inputs[G]:
                x.grad = None
            times[G].append(_step(inputs[G], args.chunk))
    med = {G: statistics.median(times[G]) for G in groups}
    result = {
        "bench": "gqa", "label": args.label, "operator": "hla2", "T": args.T, "K": args.K,
        "V": args.K,
        "Hq": args.heads, "chunk": args.chunk, "dtype": "float32", "reps": args.reps,
        "threads": args.threads, "clock": "thread_time", "torch": torch.__version__,
        "host": platform.node(),
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "seconds_median": {str(G): med[G] for G in groups},
        "seconds_all": {str(G): times[G] for G in groups},
        "ratio_to_G1": {str(G): med[G] / med[1] for G in groups},
        "ratio_of_minima_to_G1": {str(G): min(times[G]) / min(times[1]) for G in groups},
    }
    for G in groups:
        print(f"G={G} Hkv={args.heads // G}: {med[G] * 1e3:8.1f} ms  "
              f"ratio {med[G] / med[1]:.3f} (of minima {min(times[G]) / min(times[1]):.3f})")
    print(f"load average before {load_before}, after {result['loadavg_after']}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"gqa_T{args.T}_K{args.K}{args.label}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

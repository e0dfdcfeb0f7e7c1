"""Where a fwd+bwd of linear_attention and hla2 spends its time on a GPU (torch.profiler).

bench_gpu.py gives the totals; this gives the split: each CUDA kernel's time, the host's
time, and the count of launches, for one call after warm-up (B=1, H=16, K=V=128, bf16).

    python benchmarks/profile_gpu.py --T 32768 --out runs/bench/profile_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import hla_sp


def one_call(op: str, T: int, H: int, K: int, V: int, device: str) -> dict:
    """Profile one fwd+bwd of ``op`` after three warm-ups; the top kernels by CUDA time."""
    q, k, v = (torch.randn(1, T, H, d, device=device, dtype=torch.bfloat16,
                           requires_grad=True) for d in (K, K, V))
    a = (-torch.rand(H, device=device) * 0.05).requires_grad_()
    do = torch.randn(1, T, H, V, device=device, dtype=torch.bfloat16)
    fn = getattr(hla_sp, op)

    def step() -> None:
        fn(q, k, v, log_decay=a)[0].backward(do)

    for _ in range(3):
        step()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        step()
        sync()
    wall = time.perf_counter() - t0
    attr = "device_time_total" if device == "cuda" else "cpu_time_total"
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, attr, 0.0), reverse=True)
    kernels = [dict(name=e.key[:90], calls=e.count, ms=getattr(e, attr, 0.0) / 1e3)
               for e in rows[:25]]
    print(f"== {op} T={T}: wall {wall * 1e3:.1f} ms (profiled)")
    for r in kernels:
        print(f"  {r['ms']:9.3f} ms  {r['calls']:5d}x  {r['name']}")
    return dict(op=op, T=T, H=H, K=K, V=V, wall_ms=wall * 1e3, top=kernels)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--ops", default="linear_attention,hla2")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=Path("runs/bench/profile_gpu.json"))
    a = p.parse_args()
    os.environ.setdefault("HLA_SP_BACKEND", "triton")
    res = [one_call(op, a.T, 16, 128, 128, a.device) for op in a.ops.split(",")]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A first run of the operators on CPU, well under a minute.

1. Checks the chunk-parallel path of every operator against its serial per-token
   recurrence (outputs, final states and the gradients of q, k, v), in fp64 and
   fp32, with a per-head decay and a length that is not a multiple of the chunk.
2. Prints a small speed table, forward + backward: hla2, linear_attention and
   causal softmax attention (torch SDPA).

    python benchmarks/ops_demo.py          # or: make demo-ops

Exits non-zero if any check fails. The speed table is information, not a check.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import hla_sp
from hla_sp.ops import reference

# Relative error bounds (max |x - ref| / max |ref|). fp64: the chunked and serial
# orders of summation differ only by rounding, ~1e-15 per term. fp32: both sides
# are compared with the fp64 recurrence; fp32 rounding (~6e-8) amplified by the
# sums over T = 100 tokens and the composition's two stages stays far below 1e-4.
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}

# name -> (chunked operator, serial recurrence)
OPERATORS: dict[str, tuple[Callable, Callable]] = {
    "linear_attention": (hla_sp.linear_attention, reference.recurrent_linear_attention),
    "hla2": (hla_sp.hla2, reference.recurrent_hla2),
    "ahla": (hla_sp.ahla, reference.recurrent_ahla),
    "hla3": (hla_sp.hla3, reference.recurrent_hla3),
}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref|, computed in fp64."""
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def _flat_state(state: object) -> list[torch.Tensor]:
    """A state tensor or tuple of tensors (None fields dropped) as a list."""
    if isinstance(state, torch.Tensor):
        return [state]
    return [s for s in state if s is not None]


def check_operator(name: str, dtypes: tuple[torch.dtype, ...], T: int = 100) -> dict:
    """Worst relative error of the chunked ``name`` per dtype against the fp64 recurrence."""
    fast, slow = OPERATORS[name]
    gen = torch.Generator().manual_seed(0)
    B, H, K, V = 1, 2, 16, 24  # K != V on purpose
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    log_decay = -torch.rand(H, generator=gen, dtype=torch.float64) * 0.1  # per-head constant
    do = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)

    def run(fn: Callable, dt: torch.dtype, **kw: object) -> list[torch.Tensor]:
        ins = [x.detach().to(dt, copy=True).requires_grad_() for x in (q, k, v)]
        o, state = fn(*ins, log_decay=log_decay.to(dt), **kw)
        o.backward(do.to(dt))
        return [o, *_flat_state(state), *(x.grad for x in ins)]

    ref = run(slow, torch.float64)  # the serial recurrence is the slow part: run it once
    errs = {}
    for dtype in dtypes:
        got = run(fast, dtype, output_final_state=True)
        if len(ref) != len(got):
            raise RuntimeError(f"{name}: {len(got)} results against {len(ref)} in the reference")
        errs[dtype] = max(rel_err(g, r) for g, r in zip(got, ref))
    return errs


def run_checks() -> bool:
    """Print and judge every operator in fp64 and fp32; True when all pass."""
    print("Chunked path vs serial recurrence (T=100, chunk 64, per-head decay, K=16, V=24)")
    print("max relative error over output, final state and grads of q, k, v:")
    print(f"  {'operator':18s} {'fp64':>10s} {'fp32':>10s}")
    ok = True
    for name in OPERATORS:
        errs = check_operator(name, (torch.float64, torch.float32))
        passed = all(e <= TOL[dt] for dt, e in errs.items())
        ok &= passed
        print(f"  {name:18s} {errs[torch.float64]:10.2e} {errs[torch.float32]:10.2e}"
              f"  {'ok' if passed else 'FAIL'}")
    print(f"  bounds: fp64 <= {TOL[torch.float64]:.0e}, fp32 <= {TOL[torch.float32]:.0e}")
    return ok


def time_fwd_bwd(fn: Callable, T: int, reps: int) -> float:
    """Median seconds of forward + backward at B=1, H=4, K=V=64, fp32."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, 4, 64, generator=gen).requires_grad_() for _ in range(3))
    fn(q, k, v).sum().backward()  # warm-up, not timed
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(q, k, v).sum().backward()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def speed_table(Ts: list[int], reps: int) -> None:
    """Print fwd+bwd times of hla2, linear_attention and causal SDPA."""
    fns = {
        "hla2": lambda q, k, v: hla_sp.hla2(q, k, v)[0],
        "linear_attention": lambda q, k, v: hla_sp.linear_attention(q, k, v)[0],
        "causal SDPA": lambda q, k, v: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True),
    }
    print(f"\nSpeed, fp32 forward+backward, B=1 H=4 K=V=64, {torch.get_num_threads()} threads, "
          f"median of {reps} (shared machines make these noisy):")
    print(f"  {'T':>6s} " + " ".join(f"{n:>17s}" for n in fns) + f" {'SDPA/hla2':>10s}")
    for T in Ts:
        t = {n: time_fwd_bwd(f, T, reps) for n, f in fns.items()}
        print(f"  {T:6d} " + " ".join(f"{t[n] * 1e3:14.1f} ms" for n in fns)
              + f" {t['causal SDPA'] / t['hla2']:9.2f}x", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ts", type=int, nargs="*", default=[1024, 4096, 8192],
                   help="lengths for the speed table (none: skip it)")
    p.add_argument("--reps", type=int, default=3, help="timed repeats per entry")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    ok = run_checks()
    if args.ts:
        speed_table(args.ts, args.reps)
    print(f"\n{'all checks passed' if ok else 'SOME CHECKS FAILED'} "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

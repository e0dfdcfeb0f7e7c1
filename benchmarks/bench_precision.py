"""Error of the 16-bit fast path against fp64, beside the exact path and the naive form.

For hla2, ahla and hla3 with bf16 inputs, each path's output and input gradients are
compared with the fp64 result of the same (bf16-rounded) inputs:

- ``exact``: the stages in fp32, rounded once at the output (``precision="exact"``);
- ``fast``: 16-bit operands, fp32 accumulation, k~/u rounded once per stage;
- ``naive_bf16``: the naive quadratic form computed in bf16 (flash-attention's yardstick:
  the tests require ``fast`` within twice its error).

Errors are max |x - x64| / max |x64| per tensor. Without decay by default: the naive
form casts the log-decay to bf16 too, whose cumulative sum loses digits with T (at
T = 4096 its exponents are off by up to ~0.5), which would flatter the fast path;
``--decay`` adds a per-token decay (-0.05 a token at most) anyway. ``--backend
triton`` runs the kernels (on CPU under Triton's interpreter, slow: use small T).
Writes JSON.

    python benchmarks/bench_precision.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
from pathlib import Path

import torch

import hla_sp
from hla_sp.ops import reference as R
from hla_sp.ops.dispatch import use_backend

OPS = {"hla2": (hla_sp.hla2, R.naive_hla2), "ahla": (hla_sp.ahla, R.naive_ahla),
       "hla3": (hla_sp.hla3, R.naive_hla3)}
NAMES = ("o", "dq", "dk", "dv", "dlog_decay")


def run_path(op: str, path: str, q, k, v, g, do) -> list[torch.Tensor]:
    """Output and gradients (q, k, v[, log-decay]) of one path; fp64 for ``path="fp64"``."""
    fn, naive = OPS[op]
    dt = torch.float64 if path == "fp64" else q.dtype
    leaves = [x.to(dt).clone().requires_grad_() for x in (q, k, v)]
    gl = None
    if g is not None:
        gl = g.to(torch.float64 if path == "fp64" else (dt if path == "naive_bf16" else
                                                        torch.float32)).clone()
        leaves.append(gl.requires_grad_())
    # the fp64 reference on the torch path: the kernels take no fp64
    with use_backend("torch") if path == "fp64" else contextlib.nullcontext():
        if path == "naive_bf16":
            o = naive(*leaves[:3], log_decay=gl)
        else:
            o, _ = fn(*leaves[:3], log_decay=gl, chunk_size=64,
                      precision="exact" if path in ("exact", "fp64") else "fast")
        (o * do.to(o.dtype)).sum().backward()
    return [o, *(x.grad for x in leaves)]


def measure(op: str, T: int, H: int, K: int, decay: bool, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    q, k, v = (torch.randn(1, T, H, K).bfloat16() for _ in range(3))
    g = -0.05 * torch.rand(1, T, H) if decay else None
    do = torch.randn(1, T, H, K, dtype=torch.float64)
    ref = run_path(op, "fp64", q, k, v, g, do)
    names = NAMES[: len(ref)]
    row: dict = {"op": op, "T": T, "H": H, "K": K, "decay": decay}
    for path in ("exact", "fast", "naive_bf16"):
        got = run_path(op, path, q, k, v, g, do)
        row[path] = {n: ((a.double() - b).abs().max() / b.abs().max()).item()
                     for n, a, b in zip(names, got, ref, strict=True)}
    row["fast_over_naive"] = {n: row["fast"][n] / row["naive_bf16"][n] for n in names}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--backend", choices=["torch", "triton"], default="torch")
    ap.add_argument("--decay", action="store_true", help="per-token decay (see above)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    os.environ["HLA_SP_BACKEND"] = args.backend
    if args.backend == "triton" and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    rows = []
    for T in args.T:
        for op in OPS:
            row = measure(op, T, args.heads, args.head_dim, args.decay)
            rows.append(row)
            print(f"{op} T={T}: " + "  ".join(
                f"{p} o {row[p]['o']:.2e} dq {row[p]['dq']:.2e}"
                for p in ("exact", "fast", "naive_bf16")), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"precision_{args.backend}{'_decay' if args.decay else ''}.json"
    path.write_text(json.dumps({"backend": args.backend, "machine": platform.processor(),
                                "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

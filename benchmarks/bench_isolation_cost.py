"""What document isolation costs on the CPU torch path, measured in one process.

The operators compute on clean operands and put the poison of non-finite inputs back
by flags (``hla_sp.ops.isolation``). Here the same calls run with those steps and
with them stubbed out (the flags all False, the cleaning an identity, the poisoning a
no-op: what the code computed before isolation), alternating call by call so that a
slow spell of the machine falls on both. On finite inputs both give the same outputs
(checked before timing). Each call (forward + backward, fp32, B = 1, H = 4, K = V = 64,
one thread) is timed in thread CPU time; the median and minimum per variant and their
ratios are reported.

    python benchmarks/bench_isolation_cost.py --out benchmarks/results

Unlike ``bench_revisions.py`` (whole revisions, so every other change between them is
in the ratio), this isolates the isolation's own steps on the current code.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import hla_sp
from hla_sp.ops import primitive as custom_op
from hla_sp.ops.chunk import layout, scan

OPS = ("hla2", "linear_attention")


@contextmanager
def stubbed() -> Iterator[None]:
    """The isolation's steps replaced by what the code did before it had them."""

    def no_flags(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
        return torch.zeros(k.shape[:3], dtype=torch.bool, device=k.device)

    def same(x: torch.Tensor, *_: Any) -> torch.Tensor:
        return x

    def nothing(*_: Any) -> None:
        return None

    patches = [(custom_op, "bad_tokens", no_flags), (custom_op, "poison_outputs", nothing),
               (custom_op, "poison_grads", nothing), (layout, "finite", same),
               (layout, "finite_decay", same), (scan, "finite", same)]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    for mod, name, fn in patches:
        setattr(mod, name, fn)
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def make_call(op: str, T: int, documents: bool) -> Callable[[], list[torch.Tensor]]:
    """Forward + backward of ``op`` on seeded inputs; returns o and the input gradients."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, 4, 64, generator=gen).requires_grad_() for _ in range(3))
    kw: dict[str, Any] = {}
    if documents:  # per-token decay and four packed documents
        kw["log_decay"] = (-0.05 * torch.rand(1, T, 4, generator=gen)).requires_grad_()
        kw["cu_seqlens"] = torch.tensor([0, T // 4, T // 2, 3 * T // 4, T])
    f = getattr(hla_sp, op)
    leaves = [q, k, v] + ([kw["log_decay"]] if documents else [])

    def call() -> list[torch.Tensor]:
        for x in leaves:
            x.grad = None
        o = f(q, k, v, **kw)[0]
        o.square().sum().backward()
        return [o.detach()] + [x.grad for x in leaves]

    return call


def measure(T: int, reps: int, documents: bool) -> dict[str, Any]:
    """Per op: thread CPU seconds per call with isolation ("on") and stubbed ("off")."""
    out: dict[str, Any] = {}
    for op in OPS:
        call = make_call(op, T, documents)
        on = call()
        with stubbed():
            off = call()
        for a, b in zip(on, off):  # finite inputs: the same result either way
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max())), op
        times: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(reps):
            for name in ("on", "off"):
                ctx = stubbed() if name == "off" else _nothing()
                with ctx:
                    t0 = time.thread_time()
                    call()
                    times[name].append(time.thread_time() - t0)
        med = {n: statistics.median(ts) for n, ts in times.items()}
        low = {n: min(ts) for n, ts in times.items()}
        out[op] = {"times_s": times, "median_s": med, "min_s": low,
                   "ratio_median": med["on"] / med["off"], "ratio_min": low["on"] / low["off"]}
        print(f"T={T} {'documents+decay' if documents else 'plain'} {op}: with isolation "
              f"{med['on'] * 1e3:.1f} ms, without {med['off'] * 1e3:.1f} ms (median), "
              f"x{out[op]['ratio_median']:.3f} (min x{out[op]['ratio_min']:.3f})", flush=True)
    return out


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path, default=Path("runs/bench"))
    ap.add_argument("--name", default="isolation_cost")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    data = {"python": platform.python_version(), "torch": torch.__version__,
            "config": {"T": args.T, "B": 1, "H": 4, "K": 64, "V": 64, "dtype": "float32",
                       "threads": 1, "reps": args.reps, "clock": "thread CPU time",
                       "backend": "torch"},
            "plain": measure(args.T, args.reps, False),
            "documents_decay": measure(args.T, args.reps, True)}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

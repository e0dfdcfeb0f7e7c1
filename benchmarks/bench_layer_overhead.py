"""The fixed cost per layer under sequence parallelism, where latency dominates.

A stack of ``--layers`` residual ``HLAttention`` layers (hla2 at the defaults: short
convolution, first-order path) runs forward + backward on T/P tokens per rank:

- sharded: P gloo ranks, ``SequenceParallel(layout="zigzag")``, the whole sequence T;
- sharded with a batch plan: the same, with the step's plan built once
  (``sp.plan_batch``) and passed to every layer, as the trainer and Megatron's core
  attention do;
- single-rank: the same stack on the same T/P tokens without ``sp``, on the same ranks
  at the same moment, interleaved rep by rep (so all three meet the same contention).

The ratio sharded / single-rank is the price of the exchange, the halo and every check
a layer call makes. At small T/P (512, 2,048) that price is mostly fixed per call, which
is what this measures. Also counted in the third (steady-state) sharded step of rank 0:
the collectives and the host syncs (``Tensor.item/tolist/cpu``) per layer call.

    python benchmarks/bench_layer_overhead.py                 # -> runs/bench/
    python benchmarks/bench_layer_overhead.py --out benchmarks/results
    torchrun --nproc-per-node 2 benchmarks/bench_layer_overhead.py --device cuda   # GPUs

Under torchrun the ranks are torchrun's (P = its world size; ``--ranks`` is ignored),
with NCCL and one GPU per rank for ``--device cuda``, gloo for the CPU.

With more ranks than cores the absolute times grow; the ratio is what is compared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from bench_sp_common import RESULTS, save

from hla_sp.nn import HLAttention
from hla_sp.parallel import SequenceParallel, shard
from hla_sp.testing import World

# The collectives a layer call can make (torch.distributed's own names).
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_reduce",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
               "broadcast", "send", "recv", "isend", "irecv", "batch_isend_irecv",
               "all_to_all_single", "barrier", "all_gather_object")
HOST_SYNCS = ("item", "tolist", "cpu")


@contextmanager
def counting(counts: Counter) -> Iterator[None]:
    """Count calls to torch.distributed's collectives and Tensor's host syncs."""
    saved: list[tuple[Any, str, Callable]] = []

    def wrap(owner: Any, name: str, key: str) -> None:
        fn = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[key] += 1
            return fn(*args, **kwargs)

        saved.append((owner, name, fn))
        setattr(owner, name, counted)

    # hla_sp binds some collectives under its own names at import (comm.py's aliases):
    # wrap every module attribute that is one of them, wherever it is held.
    targets = {getattr(dist, n): n for n in COLLECTIVES if hasattr(dist, n)}
    for mod in [dist] + [m for k, m in list(sys.modules.items()) if k.startswith("hla_sp")]:
        for attr, value in list(vars(mod).items()):
            if callable(value) and value in targets:
                wrap(mod, attr, targets[value])
    for name in HOST_SYNCS:
        wrap(torch.Tensor, name, f"Tensor.{name}")
    try:
        yield
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


def stack(layers: int, d: int, heads: int, seed: int = 0) -> torch.nn.ModuleList:
    """The same residual stack on every rank (seeded)."""
    torch.manual_seed(seed)
    return torch.nn.ModuleList(HLAttention(d, heads, operator="hla2") for _ in range(layers))


def step(model: torch.nn.ModuleList, x: torch.Tensor, sp: SequenceParallel | None,
         planned: bool = False) -> None:
    """Forward + backward of the stack on x [1, T_local, d]; ``planned``: one batch plan
    for every layer (built here, as a trainer builds it per micro-batch)."""
    plan = sp.plan_batch(x.shape[1]) if planned and sp is not None else None
    h = x
    for layer in model:
        h = h + layer(h, sp=sp, plan=plan)[0]
    h.square().mean().backward()


def overhead_task(rank: int, P: int, T_local: int, layers: int, d: int, heads: int,
                  reps: int, device: str = "cpu") -> dict[str, Any]:
    """Per rep: this rank's sharded and single-rank step times; the steady-state counts."""
    dev = torch.device(device)
    if dev.type == "cpu":
        torch.set_num_threads(1)

    def sync() -> None:  # a GPU step ends when its kernels do, not when they are queued
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    model = stack(layers, d, heads).to(dev)
    gen = torch.Generator().manual_seed(1)
    x_global = torch.randn(1, T_local * P, d, generator=gen)
    x_shard = shard(x_global, rank, P, "zigzag").to(dev)
    x_local = x_global[:, :T_local].to(dev)
    sp = SequenceParallel(layout="zigzag")
    paths = (("sharded", x_shard, sp, False), ("planned", x_shard, sp, True),
             ("single", x_local, None, False))
    for _ in range(2):  # warm up every path (plans, allocator, first-call checks)
        for _, x, s, planned in paths:
            step(model, x, s, planned)
    counts: dict[str, Counter] = {"sharded": Counter(), "planned": Counter()}
    for name, x, s, planned in paths[:2]:
        with counting(counts[name]):
            step(model, x, s, planned)
    times: dict[str, list[float]] = {name: [] for name, *_ in paths}
    for _ in range(reps):
        for name, x, s, planned in paths:
            model.zero_grad(set_to_none=True)
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            step(model, x, s, planned)
            sync()
            times[name].append(time.perf_counter() - t0)
    return {"times": times, "counts": {n: dict(c) for n, c in counts.items()}}


def summarize(per_rank: list[dict[str, Any]], P: int, T_local: int, layers: int,
              reps: int) -> dict[str, Any]:
    """One (P, T/P) row from every rank's times: a step lasts as long as the slowest rank."""
    step_s = {n: [max(r["times"][n][i] for r in per_rank) for i in range(reps)]
              for n in per_rank[0]["times"]}
    best = {n: min(ts) for n, ts in step_s.items()}
    med = {n: statistics.median(ts) for n, ts in step_s.items()}
    run = {"P": P, "T_local": T_local, "min_s": best, "median_s": med,
           "ratio_min": best["sharded"] / best["single"],
           "ratio_median": med["sharded"] / med["single"],
           "planned_ratio_min": best["planned"] / best["single"],
           "planned_ratio_median": med["planned"] / med["single"],
           "fixed_ms_per_layer": (best["sharded"] - best["single"]) / layers * 1e3,
           "planned_fixed_ms_per_layer": (best["planned"] - best["single"]) / layers * 1e3,
           "counts_per_layer_call": {
               n: {k: v / layers for k, v in sorted(c.items())}
               for n, c in per_rank[0]["counts"].items()}}
    print(f"P={P} T/P={T_local}: single {best['single'] * 1e3:.1f} ms; sharded "
          f"x{run['ratio_min']:.3f} (median x{run['ratio_median']:.3f}, "
          f"{run['fixed_ms_per_layer']:.2f} ms per layer); with a batch plan "
          f"x{run['planned_ratio_min']:.3f} (median x{run['planned_ratio_median']:.3f}, "
          f"{run['planned_fixed_ms_per_layer']:.2f} ms per layer); per layer call "
          f"{run['counts_per_layer_call']}", flush=True)
    return run


def under_torchrun(args: argparse.Namespace, t_locals: list[int]) -> list[dict[str, Any]] | None:
    """The rows measured on torchrun's ranks (rank 0 gets them; the others None)."""
    rank, P = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = args.device
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    rows = []
    try:
        for T_local in t_locals:
            mine = overhead_task(rank, P, T_local, args.layers, args.d_model, args.heads,
                                 args.reps, device)
            gathered: list[Any] = [None] * P if rank == 0 else []
            dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
            if rank == 0:
                rows.append(summarize(gathered, P, T_local, args.layers, args.reps))
    finally:
        dist.destroy_process_group()
    return rows if rank == 0 else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t-local", default="512,2048", help="tokens per rank, comma list")
    ap.add_argument("--ranks", default="2,4", help="P, comma list")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--name", default="layer_overhead", help="stem of the JSON and PNG")
    ap.add_argument("--out", type=Path, help="output folder (read by bench_sp_common)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: one GPU per rank, under torchrun")
    args = ap.parse_args(argv)
    data: dict[str, Any] = {
        "config": {"operator": "hla2", "layout": "zigzag", "layers": args.layers,
                   "d_model": args.d_model, "heads": args.heads, "reps": args.reps,
                   "threads_per_rank": 1, "device": args.device,
                   "stat": "per rep the slowest rank; min and median over reps"},
        "runs": []}
    t_locals = [int(t) for t in args.t_local.split(",")]
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rows = under_torchrun(args, t_locals)
        if rows is None:
            return
        data["runs"] = rows
    else:
        if args.device != "cpu":
            ap.error(f"--device {args.device}: expected cpu without torchrun (a pool of gloo "
                     "ranks on this host); launch with torchrun for GPUs")
        for P in (int(p) for p in args.ranks.split(",")):
            for T_local in t_locals:
                with World(P) as w:
                    per_rank = w.run(overhead_task, T_local, args.layers, args.d_model,
                                     args.heads, args.reps, timeout=1800)
                data["runs"].append(summarize(per_rank, P, T_local, args.layers, args.reps))
    path = save(args.name, data)
    print(f"wrote {path}")
    plot(data, RESULTS / f"{args.name}.png")


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for P in sorted({r["P"] for r in data["runs"]}):
        rows = [r for r in data["runs"] if r["P"] == P]
        line, = ax.plot([r["T_local"] for r in rows], [r["ratio_min"] for r in rows], "o-",
                        label=f"P = {P}, a plan per call")
        ax.plot([r["T_local"] for r in rows], [r.get("planned_ratio_min", float("nan"))
                                               for r in rows], "s--", color=line.get_color(),
                label=f"P = {P}, a plan per batch")
    ax.axhline(1.0, color="k", lw=0.8)
    c = data["config"]
    ax.set(xscale="log", xlabel="T / P (tokens per rank)",
           ylabel="sharded step / single-rank step",
           title=f"{c['layers']} hla2 layers, d={c['d_model']}, fwd+bwd "
                 f"({'GPU, NCCL' if c.get('device') == 'cuda' else 'CPU, gloo'})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

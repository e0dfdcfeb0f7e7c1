"""Memory per rank with and without --use-distributed-optimizer, measured on CPU.

Each launch trains a small GPT (--bf16) for a few steps under torchrun on gloo; every
rank reports the bytes of its optimizer state (the fp32 tensors AdamW steps and its two
moments, this rank's rows of them when sharded), its peak RSS (VmHWM), its RSS after
the steps (VmRSS) and the memory
model's weights, gradients and AdamW per rank (``launch/model/estimate.py``).

    python benchmarks/bench_dist_optimizer.py                 # DP 2 and DP 4
    python benchmarks/bench_dist_optimizer.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MODEL = [
    "--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
    "--seq-length", "64", "--micro-batch-size", "1", "--train-iters", "3", "--bf16",
    "--log-interval", "100",
]  # fmt: skip
MIB = 2**20


def _rss() -> int:
    """This process's resident set now (VmRSS), bytes."""
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))


def worker(flags: list[str], out: str) -> None:
    """One rank: train, then write this rank's figures to ``out``.rank<r>.json."""
    import torch.distributed as dist
    from hla_sp.launch.config.train_config import parse_args
    from hla_sp.launch.distributed.dist_optimizer import optimizer_state_bytes
    from hla_sp.launch.distributed.process_groups import init_distributed, shutdown
    from hla_sp.launch.model.estimate import estimate
    from hla_sp.launch.train import metrics
    from hla_sp.launch.train.trainer import Trainer

    cfg = parse_args(flags)
    topo = init_distributed(1, 1, 10)
    metrics.reset_peak_memory()
    trainer = Trainer(cfg, topo)
    trainer.train()
    row = {"rank": topo.rank, "optimizer_state_bytes": optimizer_state_bytes(trainer.optimizer),
           "peak_rss_bytes": metrics.peak_memory_bytes(), "rss_after_bytes": _rss(),
           "params": sum(p.numel() for p in trainer.model.parameters()),
           "model_state_bytes": estimate(cfg, topo.world_size).state_bytes}
    Path(f"{out}.rank{topo.rank}.json").write_text(json.dumps(row))
    dist.barrier()
    shutdown(topo)


def launch(nproc: int, sharded: bool, out: str) -> list[dict]:
    flags = [*MODEL, *(["--use-distributed-optimizer"] if sharded else [])]
    from hla_sp.launch.distributed.local import worker_env

    env = worker_env(None)  # hla-sp train's: one thread, the fixed mmap threshold
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={nproc}", __file__, "--worker", out, *flags],
                   check=True, env=env)  # fmt: skip
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(nproc)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/bench")
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    data: dict = {"config": " ".join(MODEL), "unit": "MiB per rank (max over ranks)"}
    for dp in args.dp:
        for sharded in (False, True):
            rows = launch(dp, sharded, os.path.join(args.out, f"dopt_{dp}_{int(sharded)}"))
            entry = {k: max(r[k] for r in rows) / MIB
                     for k in ("optimizer_state_bytes", "peak_rss_bytes", "rss_after_bytes",
                               "model_state_bytes")}
            entry["params"] = rows[0]["params"]
            data[f"dp{dp}_{'sharded' if sharded else 'whole'}"] = entry
            print(f"DP {dp} {'--use-distributed-optimizer' if sharded else 'unsharded':>27}: "
                  f"optimizer state {entry['optimizer_state_bytes']:7.1f} MiB, peak RSS "
                  f"{entry['peak_rss_bytes']:7.1f} MiB, RSS after the steps "
                  f"{entry['rss_after_bytes']:7.1f} MiB, memory model (weights, gradients, "
                  f"AdamW) {entry['model_state_bytes']:7.1f} MiB per rank", flush=True)
    path = Path(args.out) / "dist_optimizer.json"
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[3:], sys.argv[2])
    else:
        main()

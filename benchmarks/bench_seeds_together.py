"""Host time per seed-step: N recall runs one after another against N seeds together.

At the capacity study's size on a GPU the work of a step is a few hundred tiny kernels
(docs/quality.md: 32 runs at once on one H200 reached about 3 TFLOP/s), so what a step
costs is its launches and the Python around them. This measures that cost where it can
be measured without a GPU: on the CPU, at a size so small that the arithmetic is
negligible (T = 16, d_model 16, 2 sequences a step), the wall time of one seed's step
when N runs train one after another (``bench_recall.train``) and when N seeds train
together under ``torch.vmap`` (``recall_seeds.train_seeds``). Steps are timed as the
difference of two schedule lengths, so building the models and the final evaluation
cancel. One thread; run it with nothing else heavy on the machine.

    python benchmarks/bench_seeds_together.py          # hla2, linear, softmax; 8 seeds

Writes ``<out>/seeds_together.json``: per mixer, milliseconds per seed-step each way and
their ratio (together / alone).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_recall as BR
import recall_seeds as RS

ROOT = Path(__file__).resolve().parents[1]
SIZE = dict(T=16, pairs=2, batch=2, lr=3e-3, d=16, eval_every=10**9, early_stop=None)


def seconds(mixer: str, seeds: int, steps: int, together: bool) -> float:
    """Wall seconds of ``seeds`` runs of ``steps`` steps, together or one by one."""
    t0 = time.perf_counter()
    if together:
        RS.train_seeds(mixer, seeds=list(range(seeds)), steps=steps, **SIZE)
    else:
        for s in range(seeds):
            BR.train(mixer, seed=s, steps=steps, **SIZE)
    return time.perf_counter() - t0


def measure(mixer: str, seeds: int, steps: int) -> dict[str, Any]:
    """ms per seed-step alone and together (the difference of ``steps`` + 10 and 10
    steps, after a warm-up of 2), and the ratio together / alone."""
    row: dict[str, Any] = {}
    for way in ("alone", "together"):
        seconds(mixer, seeds, 2, way == "together")
        long = seconds(mixer, seeds, steps + 10, way == "together")
        short = seconds(mixer, seeds, 10, way == "together")
        row[f"ms_per_seed_step_{way}"] = (long - short) / (steps * seeds) * 1e3
    row["ratio"] = row["ms_per_seed_step_together"] / row["ms_per_seed_step_alone"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mixers", default="hla2,linear,softmax")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100, help="timed steps per way")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = {"size": {k: v for k, v in SIZE.items() if k != "early_stop"}, "seeds": a.seeds,
           "steps": a.steps, "torch": torch.__version__, "threads": 1, "mixers": {}}
    for m in a.mixers.split(","):
        res["mixers"][m] = row = measure(m, a.seeds, a.steps)
        print(f"{m:14s} alone {row['ms_per_seed_step_alone']:.3f} ms  together "
              f"{row['ms_per_seed_step_together']:.3f} ms  ratio {row['ratio']:.3f}",
              flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "seeds_together.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out / 'seeds_together.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The capacity study on one GPU: MQAR at (512, 64), d_model 128, over many seeds.

On the CPU every mixer, softmax included, mostly stays on the loss plateau within the
3,000 steps a run can afford there (docs/quality.md). Whether a larger state buys
recall capacity needs a longer schedule over many seeds. The models are small: one run
alone leaves a GPU mostly idle. The first lease ran the 32 runs side by side, one process
each, and got about 3 TFLOP/s in total: 32 processes taking turns on the GPU and on 16
host cores, each bound by its kernel launches. So each mixer's seeds now train together
in one process, their weights stacked under ``torch.vmap`` (recall_seeds.py: the same
runs, up to rounding), and the four mixers' processes share the GPU; ``--separate``
runs the first lease's way, one process per run.

    python benchmarks/gpu_quality.py --plan      # the sizing below, from the FLOPs,
                                                 # beside the pace one H200 measured
    python benchmarks/gpu_quality.py             # the study (CUDA), about 8 minutes
    python benchmarks/gpu_quality.py --device cpu --toy    # the same code at a toy size

Sizing. A step is B = 4096 / T = 8 sequences of T = 512. Its FLOPs are the dense layers
(counted by ``torch.utils.flop_counter`` on one step) plus the mixer's, which a custom
op hides from the counter and which are counted here from their shapes: the causal
softmax's QK^T and PV, or each primitive stage of the chunk path (chunk C = 64) with
its per-chunk scores, outputs and state updates; the backward is twice the forward.
That is about 10-15 GFLOP a step, so ``STEPS`` x ``RUNS`` is a few PFLOP: at an assumed
sustained 20 TFLOP/s (a fraction of an H200's dense fp32/TF32 rate, since these
matrices are tiny) the FLOPs take a few minutes. Small models are bound by kernel
launches rather than FLOPs, which no FLOP count sees: the first lease ran the 32 runs at
222 steps a second in all, about 3 TFLOP/s. With 8 seeds to each kernel, the same rate
of kernels makes 8 times the seed-steps (``--plan`` prints this model beside the
measured pace). The study also takes a wall budget (``--budget-s``, 420 s by default):
no run takes a step past it, and a run it cut records where (``cut_at``), so the study
ends within 8 minutes whatever the GPU's pace and the table says which runs finished
their schedule.

Results go to ``runs/gpu_quality/recall_gpu.json`` (and ``.png``), with the markdown
table printed at the end for docs/quality.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_recall as BR

ROOT = Path(__file__).resolve().parents[1]
MIXERS = ("hla2", "linear", "gated-linear", "softmax")
SIZE = (512, 64)
D_MODEL = 128
SEEDS = 8
STEPS = 10_000  # 3.3x the CPU schedule, where 2-3 of 10 seeds left the plateau
LR = 3e-3
CHUNK = 64
ASSUMED_TFLOPS = 20.0
# The first lease's study (32 runs at once on one H200): where the FLOP model meets a GPU.
MEASURED = ROOT / "benchmarks" / "results" / "gpu" / "recall_gpu_h200.json"


def dense_flops_per_step(mixer: str, T: int, d: int, batch: int) -> float:
    """FLOPs of one training step that ``torch.utils.flop_counter`` sees (projections,
    MLPs, the LM head; forward and backward) on the CPU."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = BR.RecallLM(mixer, T, d=d)
    x, y = BR.mqar_batch(batch, T, max(1, T // 8), torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100).backward()
    return float(counter.get_total_flops())


def mixer_flops_per_step(mixer: str, T: int, d: int, batch: int) -> float:
    """The mixer's own FLOPs in one step (forward x 3 for forward and backward), from the
    shapes: causal softmax, or each primitive stage of the chunk path."""
    H = BR.HEADS
    K = V = d // H
    spec = BR.MIXERS[mixer]
    if spec.get("softmax"):
        fwd = 2 * batch * H * T * T * (K + V) / 2  # causal: half of QK^T and PV
    else:
        from hla_sp.ops import table

        stages = {"linear": 1, "hla2": 2, "ahla": 2, "ccq": 2, "hla3": 3}[
            table.get(spec.get("operator", "hla2")).name]
        C = min(CHUNK, T)
        per_stage = 2 * batch * H * T * (C * K + C * V + 2 * K * V)
        fwd = stages * per_stage
    return float(BR.LAYERS * 3 * fwd)


def measured_pace(path: Path, steps: int) -> dict[str, Any] | None:
    """Steps per second per run, by mixer, in a finished study's JSON (runs cut by the
    budget count up to ``cut_at``), and the minutes ``steps`` would take at that pace
    with as many runs at once (in as many processes: seeds trained together share one);
    None when there is no such file."""
    if not path.exists():
        return None
    results = json.loads(path.read_text())["results"]
    out: dict[str, Any] = {"source": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT)
                           else str(path), "runs_at_once": len(results),
                           "processes": round(sum(1 / r.get("seeds_together", 1)
                                                  for r in results))}
    for m in sorted({r["mixer"] for r in results}):
        rates = [(r.get("cut_at") or r["steps"]) / r["seconds"] for r in results
                 if r["mixer"] == m]
        pace = sum(rates) / len(rates)
        out[m] = {"steps_per_s_per_run": pace, "minutes_for_schedule": steps / pace / 60}
    out["steps_per_s_total"] = sum((r.get("cut_at") or r["steps"]) / r["seconds"]
                                   for r in results)
    return out


def together_model(measured: dict[str, Any] | None, seeds: int,
                   steps: int) -> dict[str, Any] | None:
    """A model, not a measurement: the study's minutes with ``seeds`` seeds to each kernel,
    if the GPU runs kernels at the rate ``measured`` did with one seed to each (the rate
    of kernels, not of FLOPs, bounding both)."""
    if measured is None:
        return None
    per_process = measured["runs_at_once"] / max(measured["processes"], 1)
    rate = measured["steps_per_s_total"] * seeds / per_process  # seed-steps a second
    return {"seed_steps": len(MIXERS) * seeds * steps, "seed_steps_per_s": rate,
            "minutes": len(MIXERS) * seeds * steps / rate / 60}


def plan(T: int = SIZE[0], d: int = D_MODEL, seeds: int = SEEDS, steps: int = STEPS,
         tflops: float = ASSUMED_TFLOPS) -> dict[str, Any]:
    """FLOPs per step of each mixer, and the study's total and time at ``tflops``."""
    batch = max(1, BR.TOKENS_PER_STEP // T)
    rows = {}
    for m in MIXERS:
        dense = dense_flops_per_step(m, T, d, batch)
        mix = mixer_flops_per_step(m, T, d, batch)
        rows[m] = {"dense_gflop": dense / 1e9, "mixer_gflop": mix / 1e9,
                   "gflop_per_step": (dense + mix) / 1e9}
    total = sum(r["gflop_per_step"] for r in rows.values()) * 1e9 * seeds * steps
    return {"T": T, "d_model": d, "batch": batch, "seeds": seeds, "steps": steps,
            "per_mixer": rows, "total_pflop": total / 1e15, "assumed_tflops": tflops,
            "minutes_at_assumed_rate": total / (tflops * 1e12) / 60,
            "measured": (measured := measured_pace(MEASURED, steps)),
            "seeds_together_if_kernel_bound": together_model(measured, seeds, steps)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", action="store_true", help="print the sizing; train nothing")
    ap.add_argument("--device", default="cuda", help="cuda (the study) or cpu (--toy)")
    ap.add_argument("--toy", action="store_true",
                    help="a toy size (T=16, 2 pairs, d 16, 6 steps, 2 seeds) to test the code")
    ap.add_argument("--seeds", type=int, default=SEEDS)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="wall budget of the whole study (runs are cut there)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="processes at once (default: all of them, so the budget cuts "
                    "them alike)")
    ap.add_argument("--separate", action="store_true",
                    help="one process per run (the first lease's way), not one per mixer")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_quality")
    a = ap.parse_args(argv)
    if a.plan:
        p = plan(seeds=a.seeds, steps=a.steps)
        print(json.dumps(p, indent=1))
        return 0
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_quality: no CUDA device (use --device cpu --toy to test the code)",
              file=sys.stderr)
        return 2
    T, pairs, d, steps, seeds = (16, 2, 16, 6, 2) if a.toy else (*SIZE, D_MODEL, a.steps,
                                                                  a.seeds)
    processes = len(MIXERS) * (seeds if a.separate else 1)
    args = ["--sizes", f"{T}x{pairs}", "--d-model", str(d), "--mixers", ",".join(MIXERS),
            "--lrs", str(LR), "--seeds", ",".join(map(str, range(seeds))),
            "--steps", str(steps), "--device", a.device, "--budget-s", str(a.budget_s),
            "--jobs", str(a.jobs or processes), "--out", str(a.out), "--name", "recall_gpu"]
    if not a.separate:
        args.append("--seeds-together")
    if a.toy:
        args += ["--eval-every", "2"]
    BR.main(args)
    print(BR.markdown(BR.load_results(a.out / "recall_gpu.json")))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Language modelling on the built-in byte corpus: HLA against linear and softmax attention.

The same small model as ``bench_recall`` (pre-norm blocks of mixer + 4x MLP), byte-level
tokens of the Python standard library's sources (``hla_sp.launch.data.datasets``, no download),
a train block and a held-out validation block of windows, equal steps and nearly equal
parameters for every mixer (the layers differ by their conv taps and per-head weights,
counted in the output). AdamW, warmup and cosine, gradient clipping at 1.0. Softmax
gets rotary positions; the linear mixers need none. Each mixer runs over several seeds;
validation loss is reported in bits per byte, at the training length and at 4x it (how
each mixer extrapolates: the same held-out bytes cut into longer windows).

    python benchmarks/bench_lm.py --seeds 0,1,2 --out benchmarks/results
    python benchmarks/bench_lm.py --quick            # a smoke run

Writes ``<name>.json`` (every run and the per-mixer mean and spread; a rerun skips runs
already there) and ``<name>.png`` (validation loss against steps) under ``--out``
(default ``runs/bench_lm``, name ``lm``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_recall import MIXERS, ROOT, RecallLM, make_optimizer
from grid_runs import run_parallel, save_merged
from hla_sp.launch.data.datasets import BYTE_VOCAB, builtin_text_tokens

DEFAULT_MIXERS = ("softmax-rope", "linear", "hla2", "ahla", "hla3")
LONG = 4  # the extrapolation length, in training lengths
VALID_BYTES = 65_536  # the held-out bytes scored at each length


def split_tokens(n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) byte streams: the first 90% and the rest."""
    tokens = torch.from_numpy(builtin_text_tokens(n_tokens)[:n_tokens].astype(np.int64))
    cut = int(0.9 * len(tokens))
    return tokens[:cut], tokens[cut:]


def windows(stream: torch.Tensor, T: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping windows of T + 1 tokens [N, T + 1] from the first ``limit`` tokens."""
    s = stream if limit is None else stream[: limit + 1]
    n = (len(s) - 1) // T
    idx = torch.arange(n)[:, None] * T + torch.arange(T + 1)
    return s[idx]


@torch.no_grad()
def valid_loss(model: torch.nn.Module, w: torch.Tensor, batch: int = 32) -> float:
    """Mean next-byte loss (nats) over windows w [N, T + 1]."""
    total, n = 0.0, 0
    for i in range(0, len(w), batch):
        x = w[i : i + batch]
        logits = model(x[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        n += x[:, 1:].numel()
    return total / n


def train(mixer: str, T: int, steps: int, batch: int, d: int, layers: int, heads: int,
          lr: float, seed: int, evals: int, n_tokens: int, valid_bytes: int = VALID_BYTES,
          save_dir: str | None = None) -> dict[str, Any]:
    """Train one mixer; the validation loss along the way, at the end and at 4x length.
    With ``save_dir`` the trained weights and the model's arguments go to
    ``<save_dir>/<mixer>_seed<seed>.pt`` (what benchmarks/bench_context_use.py evaluates)."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    tr_stream, va_stream = split_tokens(n_tokens)
    tr = windows(tr_stream, T)
    va = windows(va_stream, T, valid_bytes)
    va_long = windows(va_stream, LONG * T, valid_bytes)
    model = RecallLM(mixer, T, d=d, layers=layers, heads=heads, vocab=BYTE_VOCAB)
    opt = make_optimizer(model, mixer, lr)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    gen = torch.Generator().manual_seed(seed + 1)
    curve, t0 = [], time.perf_counter()
    every = max(1, steps // evals)
    for s in range(1, steps + 1):
        w = tr[torch.randint(len(tr), (batch,), generator=gen)]
        loss = F.cross_entropy(model(w[:, :-1]).flatten(0, 1), w[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if s % every == 0 or s == steps:
            curve.append({"step": s, "valid_loss": valid_loss(model, va),
                          "train_loss": loss.item()})
    # Learned absolute positions have no row past T: such a model is not scored there.
    long = None if model.pos is not None else valid_loss(model, va_long, batch=8)
    nats = curve[-1]["valid_loss"]
    if save_dir is not None:
        os.makedirs(save_dir, exist_ok=True)
        torch.save({"mixer": mixer, "T": T, "d": d, "layers": layers, "heads": heads,
                    "vocab": BYTE_VOCAB, "seed": seed, "steps": steps, "valid_loss": nats,
                    "state_dict": model.state_dict()},
                   os.path.join(save_dir, f"{mixer}_seed{seed}.pt"))
    return {"mixer": mixer, "options": MIXERS[mixer], "T": T, "steps": steps,
            "batch": batch, "d_model": d, "layers": layers, "heads": heads, "lr": lr,
            "seed": seed, "valid_loss": nats, "valid_bpb": nats / math.log(2),
            "valid_bpb_4x": None if long is None else long / math.log(2),
            "curve": curve, "seconds": time.perf_counter() - t0,
            "params": sum(p.numel() for p in model.parameters()),
            "valid_tokens": int(va[:, 1:].numel()),
            "valid_tokens_4x": int(va_long[:, 1:].numel())}


def _job(kw: dict[str, Any]) -> dict[str, Any]:
    return train(**kw)


def run_key(r: dict[str, Any]) -> tuple:
    """What identifies a run: a rerun with the same key is skipped."""
    return (r["mixer"], r["T"], r["steps"], r["seed"])


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mixer: mean, sample std, min and max of the bits per byte at T and at 4T."""
    out = []
    for m in dict.fromkeys(r["mixer"] for r in results):
        runs = [r for r in results if r["mixer"] == m]
        row: dict[str, Any] = {"mixer": m, "seeds": len(runs), "params": runs[0]["params"]}
        for key in ("valid_bpb", "valid_bpb_4x"):
            xs = [r[key] for r in runs if r[key] is not None]
            if xs:
                row[f"{key}_mean"] = statistics.fmean(xs)
                row[f"{key}_std"] = statistics.stdev(xs) if len(xs) > 1 else 0.0
                row[f"{key}_min"], row[f"{key}_max"] = min(xs), max(xs)
        out.append(row)
    return out


def markdown(results: list[dict[str, Any]]) -> str:
    """The per-mixer summary and every seed's figure as markdown (docs/quality.md)."""
    def spread(row: dict[str, Any], key: str) -> str:
        if f"{key}_mean" not in row:
            return "-"
        return (f"{row[f'{key}_mean']:.3f} ± {row[f'{key}_std']:.3f} "
                f"[{row[f'{key}_min']:.3f}, {row[f'{key}_max']:.3f}]")

    lines = ["| mixer | parameters | seeds | bits/byte at T, mean ± std [min, max] | "
             f"at {LONG}T | per seed at T |", "|---|---|---|---|---|---|"]
    for row in summarize(results):
        seeds = sorted((r["seed"], r["valid_bpb"]) for r in results if r["mixer"] == row["mixer"])
        per_seed = ", ".join(f"{s}: {b:.3f}" for s, b in seeds)
        lines.append(f"| {row['mixer']} | {row['params']:,} | {row['seeds']} | "
                     f"{spread(row, 'valid_bpb')} | {spread(row, 'valid_bpb_4x')} | "
                     f"{per_seed} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    colors: dict[str, Any] = {}
    for r in results:
        line, = ax.plot([c["step"] for c in r["curve"]],
                        [c["valid_loss"] / math.log(2) for c in r["curve"]], lw=1,
                        color=colors.get(r["mixer"]),
                        label=None if r["mixer"] in colors else
                        f"{r['mixer']} ({r['params'] / 1e3:.0f}k params)")
        colors.setdefault(r["mixer"], line.get_color())
    ax.set(xlabel="step", ylabel="validation loss (bits / byte)",
           title="Byte-level LM on the standard library's sources (every seed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mixers", default=",".join(DEFAULT_MIXERS))
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seeds", default="0,1,2", help="comma list of seeds")
    ap.add_argument("--tokens", type=int, default=2_000_000, help="corpus size in bytes")
    ap.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_lm")
    ap.add_argument("--name", default="lm", help="stem of the JSON and PNG files")
    ap.add_argument("--save-models", default=None, metavar="DIR",
                    help="keep each trained model's weights in DIR (<mixer>_seed<seed>.pt)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 4 steps, T=32, 1 seed")
    ap.add_argument("--table", action="store_true",
                    help="print the summary of <out>/<name>.json as markdown; train nothing")
    a = ap.parse_args(argv)
    if a.table:
        print(markdown(json.loads((a.out / f"{a.name}.json").read_text())["results"]))
        return
    mixers = [m.strip() for m in a.mixers.split(",") if m.strip()]
    for m in mixers:
        if m not in MIXERS:
            raise SystemExit(f"--mixers: unknown mixer {m!r}; choose from {', '.join(MIXERS)}")
    try:
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--seeds: expected a comma list of ints, got {a.seeds!r}") from None
    T, steps, n_tokens, vb = ((32, 4, 50_000, 2_048) if a.quick
                              else (a.seq_length, a.steps, a.tokens, VALID_BYTES))
    seeds = seeds[:1] if a.quick else seeds
    out_json = a.out / f"{a.name}.json"
    results: list[dict[str, Any]] = []
    if out_json.exists():
        results = json.loads(out_json.read_text())["results"]
    done = {run_key(r) for r in results}
    jobs = [dict(mixer=m, T=T, steps=steps, batch=a.batch, d=a.d_model, layers=a.layers,
                 heads=a.heads, lr=a.lr, seed=s, evals=2 if a.quick else 10,
                 n_tokens=n_tokens, valid_bytes=vb, save_dir=a.save_models)
            for s in seeds for m in mixers if (m, T, steps, s) not in done]
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def report(r: dict[str, Any]) -> None:
        results.append(r)
        long = "-" if r["valid_bpb_4x"] is None else f"{r['valid_bpb_4x']:.3f}"
        print(f"{r['mixer']:14s} seed {r['seed']}: valid {r['valid_bpb']:.3f} bits/byte, "
              f"at {LONG}x length {long}  params {r['params']}  ({r['seconds']:.0f} s)",
              flush=True)
        save_merged(out_json, results, run_key,
                    lambda path: json.loads(path.read_text())["results"],
                    lambda rs: {"task": "byte-level LM, stdlib sources",
                                "torch": torch.__version__, "threads_per_job": 1,
                                "jobs": a.jobs, "summary": summarize(rs), "results": rs})
        plot(results, a.out / f"{a.name}.png")

    run_parallel(_job, jobs, a.jobs, report)
    print(f"wrote {out_json} and {a.out / (a.name + '.png')} "
          f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()

"""Language modelling on the built-in byte corpus: HLA against linear and softmax attention.

The same small model as ``bench_recall`` (pre-norm blocks of mixer + 4x MLP), byte-level
tokens of the Python standard library's sources (``hla_sp.launch.data``, no download),
a train block and a held-out validation block of windows, equal steps and nearly equal
parameters for every mixer (the layers differ by their conv taps and per-head weights,
counted in the output). AdamW, warmup and cosine, gradient clipping at 1.0.

    python benchmarks/bench_lm.py                 # about 15 min on 2 cores
    python benchmarks/bench_lm.py --out benchmarks/results    # refresh committed figures

Writes ``lm.json`` and ``lm.png`` (validation loss against steps) under ``--out``
(default ``runs/bench_lm``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_recall import MIXERS, ROOT, RecallLM
from hla_sp.launch.data import BYTE_VOCAB, builtin_text_tokens

DEFAULT_MIXERS = ("softmax", "linear", "hla2", "ahla", "hla3", "hla2-pure-noconv")


def windows(T: int, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, valid) windows of T + 1 byte tokens: the first 90% train, the rest held out."""
    tokens = torch.from_numpy(builtin_text_tokens(n_tokens)[:n_tokens].astype(np.int64))
    w = tokens[: len(tokens) // (T + 1) * (T + 1)].view(-1, T + 1)
    n_train = int(0.9 * len(w))
    return w[:n_train], w[n_train:]


def train(mixer: str, T: int, steps: int, batch: int, d: int, layers: int, heads: int,
          lr: float, seed: int, evals: int, n_tokens: int) -> dict[str, Any]:
    """Train one mixer; the validation loss along the way and at the end."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    tr, va = windows(T, n_tokens)
    model = RecallLM(mixer, T, d=d, layers=layers, heads=heads, vocab=BYTE_VOCAB)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    gen = torch.Generator().manual_seed(seed + 1)

    @torch.no_grad()
    def valid_loss() -> float:
        total, n = 0.0, 0
        for i in range(0, len(va), 64):
            w = va[i : i + 64]
            logits = model(w[:, :-1])
            total += F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(),
                                     reduction="sum").item()
            n += w[:, 1:].numel()
        return total / n

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
            curve.append({"step": s, "valid_loss": valid_loss(), "train_loss": loss.item()})
    return {"mixer": mixer, "T": T, "steps": steps, "batch": batch, "d_model": d,
            "layers": layers, "heads": heads, "lr": lr, "seed": seed,
            "valid_loss": curve[-1]["valid_loss"], "valid_bpb": curve[-1]["valid_loss"]
            / math.log(2), "curve": curve, "seconds": time.perf_counter() - t0,
            "params": sum(p.numel() for p in model.parameters()),
            "valid_tokens": int(va[:, 1:].numel())}


def _job(args: tuple) -> dict[str, Any]:
    return train(*args)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ax.plot([c["step"] for c in r["curve"]], [c["valid_loss"] for c in r["curve"]],
                marker="o", ms=3, label=f"{r['mixer']} ({r['params'] / 1e3:.0f}k params)")
    ax.set(xlabel="step", ylabel="validation loss (nats / byte)",
           title="Byte-level LM on the standard library's sources")
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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=2_000_000, help="corpus size in bytes")
    ap.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_lm")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 4 steps, T=32")
    a = ap.parse_args(argv)
    mixers = [m.strip() for m in a.mixers.split(",") if m.strip()]
    for m in mixers:
        if m not in MIXERS:
            raise SystemExit(f"--mixers: unknown mixer {m!r}; choose from {', '.join(MIXERS)}")
    T, steps, n_tokens = (32, 4, 50_000) if a.quick else (a.seq_length, a.steps, a.tokens)
    jobs = [(m, T, steps, a.batch, a.d_model, a.layers, a.heads, a.lr, a.seed,
             2 if a.quick else 10, n_tokens) for m in mixers]
    t0 = time.perf_counter()
    if a.jobs > 1:
        with ProcessPoolExecutor(a.jobs) as pool:
            results = list(pool.map(_job, jobs))
    else:
        results = [_job(j) for j in jobs]
    for r in results:
        print(f"{r['mixer']:20s} valid loss {r['valid_loss']:.4f} nats/byte "
              f"({r['valid_bpb']:.3f} bits)  params {r['params']}  ({r['seconds']:.0f} s)")
    a.out.mkdir(parents=True, exist_ok=True)
    data = {"task": "byte-level LM, stdlib sources", "wall_seconds": time.perf_counter() - t0,
            "torch": torch.__version__, "results": results}
    (a.out / "lm.json").write_text(json.dumps(data, indent=1))
    plot(results, a.out / "lm.png")
    print(f"wrote {a.out / 'lm.json'} and {a.out / 'lm.png'}")


if __name__ == "__main__":
    main()

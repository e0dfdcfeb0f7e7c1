"""Multi-query associative recall (MQAR): does the HLA layer learn from its context?

The task is Zoology's MQAR (Arora et al. 2023). A sequence of length T opens with
``pairs`` key-value pairs (keys from [1, vocab/2), values from [vocab/2, vocab)); every
key is queried once more later, followed by its value; every other token is the filler
0. The label at a query position is the value that follows, -100 elsewhere, so only
recall from context can beat chance (ln(vocab/2) in loss, 2/vocab in accuracy).

Each mixer is trained in the same small model (d_model 64, 2 layers of pre-norm mixer +
4x MLP, 2 heads), with fresh samples every step, AdamW (weight decay 0.1), warmup and
cosine, gradient clipping at 1.0; accuracy is measured on held-out samples along the
way and at the end. Mixers: softmax (SDPA, learned positions) and the project's layer
``hla_sp.nn.HLAttention`` with each operator at its defaults, plus the variants studied
in ``docs/quality.md``.

    python benchmarks/bench_recall.py                 # the sweep (about 30 min, 2 cores)
    python benchmarks/bench_recall.py --sizes 64x4 --mixers linear,hla2 --steps 1000
    python benchmarks/bench_recall.py --sizes 64x4 --mixers all --name recall_study
    python benchmarks/bench_recall.py --out benchmarks/results   # refresh committed figures

Writes ``<name>.json`` and ``<name>.png`` (accuracy against steps) under ``--out``
(default ``runs/bench_recall``, name ``recall``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hla_sp.nn import HLAttention

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 256
D_MODEL, LAYERS, HEADS = 64, 2, 2
EVAL_SAMPLES = 1000

# name -> HLAttention keyword arguments; "softmax" is the SDPA baseline.
MIXERS: dict[str, dict[str, Any] | None] = {
    "softmax": None,
    "linear": {"operator": "linear"},
    "hla2": {"operator": "hla2"},
    "ahla": {"operator": "ahla"},
    "hla3": {"operator": "hla3"},
    # The studied variants. "-pure": without the first-order path; "-noconv": without the
    # short convolution; "-pure-noconv" is the layer's default before this study.
    "linear-noconv": {"operator": "linear", "short_conv": 0},
    "hla2-noconv": {"operator": "hla2", "short_conv": 0},
    "hla2-pure": {"operator": "hla2", "first_order": False},
    "hla2-pure-noconv": {"operator": "hla2", "first_order": False, "short_conv": 0},
    "hla2-pure-noconv-no-onorm": {"operator": "hla2", "first_order": False, "short_conv": 0,
                                  "output_norm": False},
    "ahla-noconv": {"operator": "ahla", "short_conv": 0},
    "ahla-pure-noconv": {"operator": "ahla", "first_order": False, "short_conv": 0},
    "hla3-noconv": {"operator": "hla3", "short_conv": 0},
    "hla3-pure-noconv": {"operator": "hla3", "first_order": False, "short_conv": 0},
}
DEFAULT_MIXERS = ("softmax", "linear", "hla2", "ahla", "hla3", "hla2-pure-noconv")
# (T, pairs) -> batch: tokens per step are the same at every size.
SIZES = {(64, 4): 64, (128, 8): 32, (256, 16): 16}


def mqar_batch(batch: int, T: int, pairs: int, gen: torch.Generator,
               vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """MQAR samples: (inputs [batch, T] int64, labels [batch, T], -100 where unlabelled).

    Pairs fill positions 0 .. 2*pairs-1; each key is queried once at a distinct even
    offset after them, its value written after it, so a query never splits a pair.
    """
    half = vocab // 2
    if pairs < 1 or pairs >= half:
        raise ValueError(f"pairs: expected 1 <= pairs < {half}, got {pairs}")
    slots = torch.arange(2 * pairs, T, 2)
    if len(slots) < pairs:
        raise ValueError(f"T: expected room for {pairs} queries after the pairs "
                         f"(T >= {4 * pairs}), got {T}")
    seq = torch.zeros(batch, T + 1, dtype=torch.long)
    keys = torch.stack([torch.randperm(half - 1, generator=gen)[:pairs] + 1
                        for _ in range(batch)])
    vals = torch.randint(half, vocab, (batch, pairs), generator=gen)
    seq[:, 0 : 2 * pairs : 2] = keys
    seq[:, 1 : 2 * pairs : 2] = vals
    labels = torch.full((batch, T), -100, dtype=torch.long)
    for b in range(batch):
        pos = slots[torch.randperm(len(slots), generator=gen)[:pairs]]
        seq[b, pos] = keys[b]
        seq[b, pos + 1] = vals[b]
        labels[b, pos] = vals[b]
    return seq[:, :T], labels


class SoftmaxMixer(nn.Module):
    """Causal softmax attention (SDPA) with its own projections: the baseline."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(o.transpose(1, 2).reshape(B, T, d)), None


class RecallLM(nn.Module):
    """Embedding (+ learned positions for softmax), pre-norm blocks, tied-free LM head."""

    def __init__(self, mixer: str, T: int, d: int = D_MODEL, layers: int = LAYERS,
                 heads: int = HEADS, vocab: int = VOCAB):
        super().__init__()
        kw = MIXERS[mixer]
        self.emb = nn.Embedding(vocab, d)
        # Linear mixers are causal recurrences and need no positions; softmax does.
        self.pos = nn.Embedding(T, d) if kw is None else None
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            mix = SoftmaxMixer(d, heads) if kw is None else HLAttention(d, heads, **kw)
            self.blocks.append(nn.ModuleDict(dict(
                n1=nn.LayerNorm(d), mix=mix, n2=nn.LayerNorm(d),
                mlp=nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)))))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, vocab]."""
        h = self.emb(tokens)
        if self.pos is not None:
            h = h + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for b in self.blocks:
            h = h + b["mix"](b["n1"](h))[0]
            h = h + b["mlp"](b["n2"](h))
        return self.head(self.norm(h))


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(accuracy at the labelled positions, mean loss there)."""
    accs, losses, n = 0.0, 0.0, 0
    for i in range(0, len(x), 250):
        logits = model(x[i : i + 250])
        m = y[i : i + 250] != -100
        accs += (logits.argmax(-1)[m] == y[i : i + 250][m]).sum().item()
        losses += F.cross_entropy(logits[m], y[i : i + 250][m], reduction="sum").item()
        n += int(m.sum())
    return accs / n, losses / n


def train(mixer: str, T: int, pairs: int, steps: int, batch: int, lr: float = 3e-3,
          seed: int = 0, evals: int = 10, threads: int = 1) -> dict[str, Any]:
    """Train one mixer on one size; returns the curve and the final figures."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    ex, ey = mqar_batch(EVAL_SAMPLES, T, pairs, torch.Generator().manual_seed(10_000 + T))
    model = RecallLM(mixer, T)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    warm = max(1, steps // 10)

    def lr_at(s: int) -> float:
        return min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    every = max(1, steps // evals)
    curve, gnorms, t0 = [], [], time.perf_counter()
    for s in range(1, steps + 1):
        x, y = mqar_batch(batch, T, pairs, gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        sched.step()
        if s % every == 0 or s == steps:
            acc, eloss = evaluate(model, ex, ey)
            curve.append({"step": s, "acc": acc, "loss": eloss, "train_loss": loss.item()})
    acc, eloss = curve[-1]["acc"], curve[-1]["loss"]
    return {"mixer": mixer, "T": T, "pairs": pairs, "steps": steps, "batch": batch,
            "lr": lr, "seed": seed, "acc": acc, "loss": eloss, "curve": curve,
            "grad_norm_mean": sum(gnorms) / len(gnorms), "grad_norm_max": max(gnorms),
            "seconds": time.perf_counter() - t0,
            "params": sum(p.numel() for p in model.parameters())}


def _job(args: tuple) -> dict[str, Any]:
    return train(*args)


def plot(results: list[dict], path: Path) -> None:
    """Accuracy against steps, one panel per size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({(r["T"], r["pairs"]) for r in results})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, (T, pairs) in zip(axes[0], sizes):
        for r in results:
            if (r["T"], r["pairs"]) == (T, pairs):
                ax.plot([c["step"] for c in r["curve"]], [c["acc"] for c in r["curve"]],
                        marker="o", ms=3, label=r["mixer"])
        ax.axhline(2 / VOCAB, color="grey", lw=0.8, ls=":", label="chance")
        ax.set(title=f"MQAR T={T}, {pairs} pairs", xlabel="step", ylabel="held-out accuracy",
               ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """'64x4,128x8' -> [(64, 4), (128, 8)]."""
    out = []
    for part in text.split(","):
        try:
            T, p = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--sizes: expected TxPAIRS[,TxPAIRS...], got {text!r}") from None
        out.append((T, p))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64x4,128x8,256x16", help="TxPAIRS list")
    ap.add_argument("--mixers", default=",".join(DEFAULT_MIXERS),
                    help=f"comma list of {', '.join(MIXERS)}")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=None,
                    help="samples per step (default: 64 at T=64, fixed tokens per step)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)),
                    help="runs in parallel, one thread each")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_recall")
    ap.add_argument("--name", default="recall", help="stem of the JSON and PNG files")
    ap.add_argument("--quick", action="store_true", help="a smoke run: T=16, 2 pairs, 6 steps")
    a = ap.parse_args(argv)
    mixers = list(MIXERS) if a.mixers == "all" else [
        m.strip() for m in a.mixers.split(",") if m.strip()]
    for m in mixers:
        if m not in MIXERS:
            raise SystemExit(f"--mixers: unknown mixer {m!r}; choose from {', '.join(MIXERS)}")
    sizes = [(16, 2)] if a.quick else parse_sizes(a.sizes)
    steps = 6 if a.quick else a.steps
    jobs = []
    for T, pairs in sizes:
        batch = a.batch or SIZES.get((T, pairs), max(1, 4096 // T))
        jobs += [(m, T, pairs, steps, batch, a.lr, a.seed, 2 if a.quick else 10) for m in mixers]
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results: list[dict[str, Any]] = []

    def report(r: dict[str, Any]) -> None:
        """Print a finished run and rewrite the JSON and PNG, so a long sweep that is
        stopped keeps every run it finished."""
        results.append(r)
        print(f"T={r['T']:4d} pairs={r['pairs']:3d} {r['mixer']:26s} acc {r['acc']:.3f} "
              f"loss {r['loss']:.3f}  ({r['seconds']:.0f} s)", flush=True)
        data = {"task": "MQAR (Zoology)", "vocab": VOCAB, "d_model": D_MODEL,
                "layers": LAYERS, "heads": HEADS, "eval_samples": EVAL_SAMPLES,
                "wall_seconds": time.perf_counter() - t0,
                "machine": {"python": sys.version.split()[0], "torch": torch.__version__,
                            "cpu": platform.processor() or platform.machine(),
                            "jobs": a.jobs},
                "results": results}
        (a.out / f"{a.name}.json").write_text(json.dumps(data, indent=1))
        plot(results, a.out / f"{a.name}.png")

    if a.jobs > 1:
        with ProcessPoolExecutor(a.jobs) as pool:
            for r in pool.map(_job, jobs):  # in submission order, each as soon as it is done
                report(r)
    else:
        for j in jobs:
            report(_job(j))
    print(f"wrote {a.out / (a.name + '.json')} and {a.out / (a.name + '.png')}")


if __name__ == "__main__":
    main()

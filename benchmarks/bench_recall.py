"""Multi-query associative recall (MQAR): does the HLA layer learn from its context?

The task is Zoology's MQAR (Arora et al. 2023). A sequence of length T opens with
``pairs`` key-value pairs (keys from [1, vocab/2), values from [vocab/2, vocab)); every
key is queried once more later, followed by its value; every other token is the filler
0. The label at a query position is the value that follows, -100 elsewhere, so only
recall from context can beat chance (ln(vocab/2) in loss, 2/vocab in accuracy).

The protocol is Zoology's: every mixer gets the same short causal convolution (4 taps,
SiLU) on q, k and v and no position embeddings, softmax attention included; the
learning rate is swept; every cell runs over several seeds and stops early once the
held-out accuracy reaches 0.99. The model: d_model 64 (or ``--d-model``), 2 layers of
pre-norm mixer + 4x MLP, 2 heads; fresh samples every step, AdamW (weight decay 0.1),
10% warmup and cosine, gradient clipping at 1.0; the same tokens per step at every size.

    python benchmarks/bench_recall.py --sizes 256x16 --mixers softmax,linear,hla2 \\
        --lrs 1e-3,3e-3,1e-2 --seeds 0,1,2 --steps 3000 --name recall_grid
    python benchmarks/bench_recall.py --quick          # a smoke run

Every finished run is appended to ``<name>.json`` under ``--out`` at once (a stopped
grid keeps what it finished, and a rerun skips the runs already there), with the
per-cell summary (mean and spread of accuracy, seeds solved, median steps to 0.9) and
``<name>.png``: held-out accuracy against the recurrent state per layer, as Zoology
plots it, beside the training curves. For the layers with a first-order path each run
also logs the learned mix weights a (``key_mix``) and b (``value_mix``) per layer and
the size of the mixed-in term relative to the first-order one, |a k~| / |k|, at
several positions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from grid_runs import run_parallel, save_merged
from torch import nn

from hla_sp.nn import HLAttention
from hla_sp.nn.conv import ShortConv
from hla_sp.ops import stages as compositions

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 256
D_MODEL, LAYERS, HEADS = 64, 2, 2
CONV_TAPS = 4
EVAL_SAMPLES = 1000  # the final evaluation
CHECK_SAMPLES = 256  # the evaluations along the way (early stop, steps to 0.9)
SOLVED, REACHED = 0.99, 0.9
TOKENS_PER_STEP = 4096
SWEEP_SIZE = (256, 16)  # where the learning rate is swept; --lrs best reuses it elsewhere

# name -> the mixer's spec. "softmax": SDPA with its own projections ("rope": rotary
# positions on its q, k); "positions": learned absolute positions; "freeze": layer
# parameters kept at their initial value; every other key is an HLAttention option.
MIXERS: dict[str, dict[str, Any]] = {
    "softmax": {"softmax": True},
    # Classic softmax for language modelling: rotary positions, no convolution.
    "softmax-rope": {"softmax": True, "rope": True, "short_conv": 0},
    # The earlier baseline: learned absolute positions, no convolution.
    "softmax-pos": {"softmax": True, "positions": True, "short_conv": 0},
    "linear": {"operator": "linear"},
    # A gated first-order baseline: per-token data-dependent decay (GLA-like).
    "gated-linear": {"operator": "linear", "decay": "data"},
    "hla2": {"operator": "hla2"},
    "ahla": {"operator": "ahla"},
    "hla3": {"operator": "hla3"},
    # The query contracted by the key moment before it reads the first-order state:
    # LA(q + a S q, k, v), the idea of CCQ (arXiv 2606.01294), a learned as hla2's.
    "ccq": {"operator": "ccq"},
    # The second-order term, studied (docs/quality.md). "-raw": k~ mixed in as it is;
    # "-mixnorm": k~ scaled to unit norm per token first; "-frozen": a kept at zero.
    "hla2-raw": {"operator": "hla2", "mix_norm": False},
    "hla2-mixnorm": {"operator": "hla2", "mix_norm": True},
    "hla2-frozen": {"operator": "hla2", "mix_norm": False, "freeze": ("key_mix",)},
    "hla2-data": {"operator": "hla2", "decay": "data"},
    "hla2-ridge": {"operator": "hla2", "ridge": 1.0},
    # a's own learning rate, 0.1x the rest: Adam moves a by about the rate per step
    # whatever its gradient, and on the plateau that walk weighs a growing k~ (quality.md).
    "hla2-slowmix": {"operator": "hla2", "mix_lr": 0.1},
    # The other way: a at 10x the rate. In language modelling a starts at zero and the
    # term stays level with the linear layer; does a that can move further use it?
    "hla2-fastmix": {"operator": "hla2", "mix_lr": 10.0},
    # a started below zero: with q_j near k_j the write key k_j - |a| S_j k_j is the first
    # step of (I + |a| S_j)^-1 k_j, which takes out earlier keys' directions as the delta
    # rule does. Does a start there use the K x V memory better (quality.md)?
    "hla2-negmix": {"operator": "hla2", "mix_init": -0.05},
    # A control for the paired runs: the linear layer from the same start, every weight
    # scaled by 1 + 1e-6 N(0, 1) (about 10 fp32 roundings). If this alone changes a run's
    # outcome, one seed's outcome is not attributable to a mixer's term.
    "linear-jitter": {"operator": "linear", "jitter": 1e-6},
    # The decay schedule, studied: the learned decay starting at gamma = 1 - 2^-e with e
    # spread over (lo, hi) instead of the layer's (5, 12). (8, 12) starts the fastest
    # head with a window of 256 tokens (the whole of T = 256) instead of 32.
    "linear-slowdecay": {"operator": "linear", "decay_log2": (8.0, 12.0)},
    "hla2-slowdecay": {"operator": "hla2", "decay_log2": (8.0, 12.0)},
    # Earlier variants. "-pure": without the first-order path; "-noconv": without the
    # short convolution; "-pure-noconv" is the layer's first default.
    "linear-noconv": {"operator": "linear", "short_conv": 0},
    "hla2-noconv": {"operator": "hla2", "short_conv": 0},
    "hla2-pure": {"operator": "hla2", "first_order": False},
    "hla2-pure-noconv": {"operator": "hla2", "first_order": False, "short_conv": 0},
    "ahla-noconv": {"operator": "ahla", "short_conv": 0},
    "hla3-noconv": {"operator": "hla3", "short_conv": 0},
}
DEFAULT_MIXERS = ("softmax", "linear", "gated-linear", "hla2", "ahla", "hla3")
# The keys of a spec that are not HLAttention options.
_SPEC_KEYS = ("softmax", "positions", "freeze", "rope", "decay_log2", "mix_lr", "mix_init",
              "jitter")


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


def rotary(x: torch.Tensor, base: float = 10_000.0) -> torch.Tensor:
    """Rotary position embedding of x [B, H, T, D] (D even): pairs (i, i + D/2) rotated
    by t * base^(-2i/D). Relative positions only, so it runs at any length."""
    D, T = x.shape[-1], x.shape[-2]
    inv = base ** (-torch.arange(0, D // 2, dtype=torch.float32, device=x.device) * 2 / D)
    ang = torch.arange(T, dtype=torch.float32, device=x.device)[:, None] * inv  # [T, D/2]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class SoftmaxMixer(nn.Module):
    """Causal softmax attention (SDPA) with its own projections and, as every mixer in
    Zoology's protocol, the layer's short convolution on q, k and v (``short_conv`` 0:
    none); ``rope``: rotary positions on q and k."""

    def __init__(self, d: int, heads: int, short_conv: int = CONV_TAPS, rope: bool = False):
        super().__init__()
        self.heads, self.rope = heads, rope
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.conv = (ShortConv([("q", d, d, 0), ("k", d, d, 0), ("v", d, d, 0)], short_conv)
                     if short_conv else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        B, T, d = x.shape
        qkv = self.qkv(x)
        if self.conv is not None:
            qkv = self.conv(qkv)[0]
        q, k, v = qkv.view(B, T, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        if self.rope:
            q, k = rotary(q), rotary(k)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(o.transpose(1, 2).reshape(B, T, d)), None


@torch.no_grad()
def start_decay(layer: HLAttention, lo: float, hi: float) -> None:
    """Start a layer's learned decay at gamma_h = 1 - 2^-e_h, e_h evenly spaced over
    [lo, hi] (the layer's own start spreads e over (5, 12))."""
    bias = layer.heads.decay_bias
    e = torch.linspace(lo, hi, bias.numel(), dtype=torch.float64)
    a = torch.log1p(-torch.exp2(-e))  # log gamma
    bias.copy_(a - torch.log(-torch.expm1(a)))  # logit(gamma): logsigmoid gives back a


def layer_options(mixer: str) -> dict[str, Any]:
    """The HLAttention options of a mixer's spec."""
    return {k: v for k, v in MIXERS[mixer].items() if k not in _SPEC_KEYS}


class RecallLM(nn.Module):
    """Embedding (+ learned positions where the spec asks), pre-norm blocks, LM head."""

    def __init__(self, mixer: str, T: int, d: int = D_MODEL, layers: int = LAYERS,
                 heads: int = HEADS, vocab: int = VOCAB):
        super().__init__()
        spec = MIXERS[mixer]
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(T, d) if spec.get("positions") else None
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            if spec.get("softmax"):
                mix = SoftmaxMixer(d, heads, spec.get("short_conv", CONV_TAPS),
                                   spec.get("rope", False))
            else:
                mix = HLAttention(d, heads, **layer_options(mixer))
                if "decay_log2" in spec:
                    start_decay(mix, *spec["decay_log2"])
                if "mix_init" in spec:
                    with torch.no_grad():
                        mix.heads.key_mix.fill_(spec["mix_init"])
                for name in spec.get("freeze", ()):
                    getattr(mix.heads, name).requires_grad_(False)
            self.blocks.append(nn.ModuleDict(dict(
                n1=nn.LayerNorm(d), mix=mix, n2=nn.LayerNorm(d),
                mlp=nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)))))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if spec.get("jitter"):
            # Its own generator, so the batches and every other draw stay the seed's.
            g = torch.Generator().manual_seed(30_000)
            with torch.no_grad():
                for p in self.parameters():
                    p.mul_(1 + spec["jitter"] * torch.randn(p.shape, generator=g))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, vocab]."""
        h = self.emb(tokens)
        if self.pos is not None:
            h = h + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for b in self.blocks:
            h = h + b["mix"](b["n1"](h))[0]
            h = h + b["mlp"](b["n2"](h))
        return self.head(self.norm(h))


def state_per_layer(mixer: str, T: int, d: int = D_MODEL, heads: int = HEADS) -> int:
    """Floats a layer carries from token to token: the operator's state plus the conv's
    last W-1 inputs; softmax's KV cache (2 T d) at length T."""
    spec = MIXERS[mixer]
    if spec.get("softmax"):
        taps = spec.get("short_conv", CONV_TAPS)
        return 2 * T * d + max(taps - 1, 0) * 3 * d
    layer = HLAttention(d, heads, **layer_options(mixer))
    st = layer.init_state(1)
    return sum(t.numel() for t in torch.utils._pytree.tree_leaves(st)
               if isinstance(t, torch.Tensor))


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


@torch.no_grad()
def mix_diagnostics(model: nn.Module, x: torch.Tensor) -> list[dict[str, Any]] | None:
    """Per HLA layer: the learned decay rates gamma per head (decay "learned"); with a
    first-order path, the learned a (key_mix) and b (value_mix) per head and |w h| / |f|
    (w the weight, h the mixed-in k~ or u as it enters the mix, f the first-order k or
    v) at positions T/8, T/4, T/2, 3T/4 and T-1, averaged over the batch and heads.
    None for softmax."""
    layers = [b["mix"].heads for b in model.blocks if isinstance(b["mix"], HLAttention)]
    if not layers:
        return None
    seen: list[dict[str, torch.Tensor]] = []
    mix = compositions._mix

    def spy(higher, weight, first, norm=False):
        if weight is not None:
            h = compositions.unit_norm(higher) if norm else higher
            f = first()
            ratio = (weight[:, None] * h).norm(dim=-1) / f.norm(dim=-1).clamp_min(1e-12)
            seen.append({"ratio": ratio.mean(dim=(0, 2))})  # [T]
        return mix(higher, weight, first, norm)

    compositions._mix = spy
    try:
        model(x)
    finally:
        compositions._mix = mix
    T = x.shape[1]
    at = sorted({max(0, T // 8), T // 4, T // 2, 3 * T // 4, T - 1})
    out, i = [], 0
    for heads in layers:
        row: dict[str, Any] = {}
        if heads.decay == "learned":  # the per-head decay rates the run has learned
            row["gamma"] = [round(float(g), 5) for g in torch.sigmoid(heads.decay_bias)]
        for name in ("key_mix", "value_mix"):
            p = getattr(heads, name)
            if p is None:
                continue
            row[name] = [round(float(w), 4) for w in p]
            row[f"{name}_ratio"] = {str(t): round(float(seen[i]["ratio"][t]), 4) for t in at}
            i += 1
        out.append(row)
    return out


def param_groups(named: Any, lr: float, mix_lr: float) -> list[dict[str, Any]]:
    """The trainable parameters of ``named`` (a model, or its (name, tensor) pairs), the
    mix weights (``key_mix``, ``value_mix``) in a group of their own at ``mix_lr`` times
    the rate (the group is left out when it is empty). At ``mix_lr`` 1 one group, as
    before the option, so earlier runs reproduce bitwise."""
    pairs = list(named.named_parameters() if isinstance(named, nn.Module) else named)
    if mix_lr == 1.0:
        return [{"params": [p for _, p in pairs if p.requires_grad]}]
    mix, rest = [], []
    for name, p in pairs:
        if p.requires_grad:
            (mix if name.endswith(("key_mix", "value_mix")) else rest).append(p)
    return [g for g in ({"params": rest}, {"params": mix, "lr": lr * mix_lr}) if g["params"]]


def make_optimizer(model: Any, mixer: str, lr: float) -> torch.optim.AdamW:
    """The benchmarks' AdamW (weight decay 0.1), with the mixer's own rate for its mix
    weights where its spec asks for one (``mix_lr``): every benchmark that trains a
    ``RecallLM`` builds its optimiser here, so no variant's rate is dropped silently.
    ``model``: a module, or (name, tensor) pairs (stacked weights of many seeds)."""
    return torch.optim.AdamW(param_groups(model, lr, MIXERS[mixer].get("mix_lr", 1.0)),
                             lr=lr, weight_decay=0.1)


def lr_schedule(steps: int) -> Callable[[int], float]:
    """The factor of the peak rate at step s: 10% linear warmup, then cosine to 0."""
    warm = max(1, steps // 10)

    def lr_at(s: int) -> float:
        return min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / steps))

    return lr_at


def held_out(T: int, pairs: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """(inputs, labels) of the held-out set and the diagnostics' probe batch: the same
    samples for every seed and mixer at a size."""
    ex, ey = mqar_batch(EVAL_SAMPLES, T, pairs, torch.Generator().manual_seed(10_000 + T))
    probe = mqar_batch(16, T, pairs, torch.Generator().manual_seed(20_000 + T))[0]
    return ex.to(dev), ey.to(dev), probe.to(dev)


@dataclass
class Progress:
    """One run's checks along the way: the curve, the first step at REACHED and the
    step of the early stop."""

    curve: list[dict[str, Any]] = field(default_factory=list)
    reached: int | None = None
    stopped: int | None = None

    def check(self, model: nn.Module, s: int, train_loss: float, data: tuple[torch.Tensor, ...],
              early_stop: float | None) -> bool:
        """Evaluate ``model`` at step ``s`` on CHECK_SAMPLES held-out samples; True when the
        run stops here."""
        ex, ey, probe = data
        acc, eloss = evaluate(model, ex[:CHECK_SAMPLES], ey[:CHECK_SAMPLES])
        self.curve.append({"step": s, "acc": acc, "loss": eloss, "train_loss": train_loss,
                           "mix": mix_diagnostics(model, probe)})
        if self.reached is None and acc >= REACHED:
            self.reached = s
        if early_stop is not None and acc >= early_stop:
            self.stopped = s
        return self.stopped is not None


def run_result(model: nn.Module, data: tuple[torch.Tensor, ...], progress: Progress,
               gnorms: tuple[float | None, float | None], seconds: float,
               cut: int | None, **setting: Any) -> dict[str, Any]:
    """The stored record of a finished run: ``setting`` (mixer, T, pairs, d_model, steps,
    batch, lr, seed), the final figures on the whole held-out set, the curve."""
    acc, eloss = evaluate(model, data[0], data[1])
    mixer, T, d = setting["mixer"], setting["T"], setting["d_model"]
    return {"mixer": mixer, "options": MIXERS[mixer], **setting,
            "acc": acc, "loss": eloss, "solved": solved(progress.stopped, acc),
            "steps_to_0.9": progress.reached, "stopped_at": progress.stopped,
            "curve": progress.curve, **({"cut_at": cut} if cut is not None else {}),
            "grad_norm_mean": gnorms[0], "grad_norm_max": gnorms[1], "seconds": seconds,
            "params": sum(p.numel() for p in model.parameters()),
            "state_per_layer": state_per_layer(mixer, T, d),
            "device": data[0].device.type}


def train(mixer: str, T: int, pairs: int, steps: int, batch: int, lr: float = 3e-3,
          seed: int = 0, d: int = D_MODEL, eval_every: int = 100,
          early_stop: float | None = SOLVED, threads: int = 1, device: str = "cpu",
          deadline: float | None = None) -> dict[str, Any]:
    """Train one mixer on one size; returns the curve and the final figures.

    ``device``: where the model trains (the samples are drawn on the CPU from the same
    generators, so a seed is the same data on any device). ``deadline``: a
    ``time.time()`` after which no further step is taken; such a run records
    ``"cut_at"``, the last step it took (the schedule was sized for ``steps``)."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed + 1)
    data = held_out(T, pairs, dev)
    model = RecallLM(mixer, T, d=d).to(dev)
    opt = make_optimizer(model, mixer, lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(steps))
    progress, gnorms, t0, cut = Progress(), [], time.perf_counter(), None
    for s in range(1, steps + 1):
        if deadline is not None and time.time() >= deadline:
            cut = s - 1
            break
        x, y = (t.to(dev) for t in mqar_batch(batch, T, pairs, gen))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        sched.step()
        if (s % eval_every == 0 or s == steps) and progress.check(
                model, s, loss.item(), data, early_stop):
            break
    return run_result(model, data, progress,
                      (sum(gnorms) / len(gnorms), max(gnorms)) if gnorms else (None, None),
                      time.perf_counter() - t0, cut, T=T, pairs=pairs, d_model=d,
                      steps=steps, batch=batch, lr=lr, seed=seed, mixer=mixer)


def solved(stopped_at: int | None, acc: float) -> bool:
    """A run solved the task if its held-out check reached SOLVED (where it stops early)
    or its final accuracy on the larger held-out set did."""
    return stopped_at is not None or acc >= SOLVED


def load_results(path: Path) -> list[dict[str, Any]]:
    """The runs stored in ``path``, each run's ``solved`` recomputed by ``solved()``: runs
    written before the rule counted an early stop store the older flag."""
    results = json.loads(path.read_text())["results"]
    for r in results:
        r["solved"] = solved(r["stopped_at"], r["acc"])
    return results


def _job(kw: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
    if "seeds" in kw:
        from recall_seeds import train_seeds

        return train_seeds(**kw)
    return train(**kw)


def together(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs of ``jobs`` that differ only in their seed, as one job each (``seeds``:
    their seeds, in order), for :func:`recall_seeds.train_seeds`."""
    groups: dict[tuple, dict[str, Any]] = {}
    for kw in jobs:
        rest = {k: v for k, v in kw.items() if k != "seed"}
        key = tuple(sorted(rest.items()))
        groups.setdefault(key, {**rest, "seeds": []})["seeds"].append(kw["seed"])
    return list(groups.values())


def run_key(r: dict[str, Any]) -> tuple:
    """What identifies a run: a rerun with the same key is skipped."""
    return (r["mixer"], r["T"], r["pairs"], r["d_model"], r["steps"], float(r["lr"]),
            r["seed"])


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell (mixer, size, d_model, steps, lr): mean, spread (sample std, min, max)
    of accuracy, seeds solved, median steps to 0.9 (over the seeds that got there; None
    when fewer than half did), and whether it is the mixer's best learning rate there."""
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        cells.setdefault(run_key(r)[:-1], []).append(r)
    out = []
    for key, runs in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][3], kv[0][0],
                                                           kv[0][5])):
        accs = [r["acc"] for r in runs]
        hits = sorted(r["steps_to_0.9"] for r in runs if r["steps_to_0.9"] is not None)
        out.append({
            "mixer": key[0], "T": key[1], "pairs": key[2], "d_model": key[3],
            "steps": key[4], "lr": key[5], "seeds": len(runs),
            "acc_mean": statistics.fmean(accs),
            "acc_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
            "acc_min": min(accs), "acc_max": max(accs),
            "solved": sum(solved(r["stopped_at"], r["acc"]) for r in runs),
            "median_steps_to_0.9": statistics.median(hits) if 2 * len(hits) >= len(runs)
            else None,
            "state_per_layer": runs[0]["state_per_layer"]})
    best: dict[tuple, dict[str, Any]] = {}
    for c in out:
        k = (c["mixer"], c["T"], c["pairs"], c["d_model"], c["steps"])
        if k not in best or (c["acc_mean"], c["solved"]) > (best[k]["acc_mean"],
                                                             best[k]["solved"]):
            best[k] = c
    for c in out:
        c["best_lr"] = best[(c["mixer"], c["T"], c["pairs"], c["d_model"], c["steps"])] is c
    return out


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Per size: held-out accuracy against state per layer (each mixer at its best
    learning rate, mean and seeds' range), and the training curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in summarize(results) if c["best_lr"]]
    sizes = sorted({(c["T"], c["pairs"], c["d_model"]) for c in cells})
    # One colour per mixer across every panel: the default cycle of 10 repeats at
    # (256, 16), where the study's variants make more than 10 mixers.
    cmap = plt.get_cmap("tab20")
    colors = {m: cmap(i % 20) for i, m in enumerate(sorted({r["mixer"] for r in results}))}
    fig, axes = plt.subplots(2, len(sizes), figsize=(5.5 * len(sizes), 8.5), squeeze=False)
    for j, (T, pairs, d) in enumerate(sizes):
        ax = axes[0][j]
        for c in cells:
            if (c["T"], c["pairs"], c["d_model"]) == (T, pairs, d):
                ax.errorbar(c["state_per_layer"], c["acc_mean"],
                            yerr=[[c["acc_mean"] - c["acc_min"]], [c["acc_max"] - c["acc_mean"]]],
                            fmt="o", capsize=3, color=colors[c["mixer"]],
                            label=f"{c['mixer']} (lr {c['lr']:g}, "
                            f"{c['solved']}/{c['seeds']} solved)")
        ax.set(xscale="log", title=f"MQAR T={T}, {pairs} pairs, d_model {d}",
               xlabel="state per layer (floats)", ylabel="held-out accuracy", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax = axes[1][j]
        labelled: set[str] = set()
        for r in results:
            if (r["T"], r["pairs"], r["d_model"]) == (T, pairs, d):
                ax.plot([c["step"] for c in r["curve"]], [c["acc"] for c in r["curve"]],
                        lw=1, color=colors[r["mixer"]],
                        label=None if r["mixer"] in labelled else r["mixer"])
                labelled.add(r["mixer"])
        ax.axhline(2 / VOCAB, color="grey", lw=0.8, ls=":")
        ax.set(xlabel="step", ylabel="held-out accuracy (256 samples)", ylim=(0, 1.02),
               title="every run (all learning rates and seeds)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(results: list[dict[str, Any]]) -> str:
    """The per-cell summary as a markdown table (docs/quality.md quotes it)."""
    lines = ["| size (T, pairs) | d_model | mixer | lr | seeds | accuracy mean ± std "
             "[min, max] | solved | median steps to 0.9 | state per layer |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in summarize(results):
        med = c["median_steps_to_0.9"]
        lines.append(
            f"| ({c['T']}, {c['pairs']}) | {c['d_model']} | {c['mixer']} | {c['lr']:g}"
            f"{' (best)' if c['best_lr'] else ''} | {c['seeds']} | {c['acc_mean']:.3f} ± "
            f"{c['acc_std']:.3f} [{c['acc_min']:.3f}, {c['acc_max']:.3f}] | "
            f"{c['solved']}/{c['seeds']} | {'-' if med is None else f'{med:g}'} | "
            f"{c['state_per_layer']:,} |")
    return "\n".join(lines)


def _floats(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: expected a comma list of numbers, got {text!r}") from None


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
    ap.add_argument("--sizes", default="256x16", help="TxPAIRS list, e.g. 64x4,256x16")
    ap.add_argument("--d-model", default="64", help="comma list of model widths")
    ap.add_argument("--mixers", default=",".join(DEFAULT_MIXERS),
                    help=f"comma list of {', '.join(MIXERS)}")
    ap.add_argument("--steps", type=int, default=3000, help="the schedule's length")
    ap.add_argument("--lrs", default="3e-3",
                    help="comma list of peak learning rates, or 'best': per mixer, its best "
                    f"rate at the sweep's size {SWEEP_SIZE} (d_model {D_MODEL}) in <name>.json")
    ap.add_argument("--seeds", default="0,1,2", help="comma list of seeds")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--no-early-stop", action="store_true",
                    help=f"train every run to the end (default: stop at {SOLVED})")
    ap.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)),
                    help="runs in parallel, one thread each")
    ap.add_argument("--seeds-together", action="store_true",
                    help="train a cell's seeds in one process, their weights stacked under "
                    "torch.vmap (recall_seeds.py): one job per mixer and rate, not per seed")
    ap.add_argument("--device", default="cpu",
                    help="where every run trains: cpu, or cuda (the runs share the one GPU, "
                    "each in its own process)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="a wall-clock budget for the whole grid: no run takes a step past "
                    "it, and a run it cut records the step (cut_at)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_recall")
    ap.add_argument("--name", default="recall", help="stem of the JSON and PNG files")
    ap.add_argument("--quick", action="store_true", help="a smoke run: T=16, 2 pairs, 6 steps")
    ap.add_argument("--table", action="store_true",
                    help="print the summary of <out>/<name>.json as markdown; train nothing")
    a = ap.parse_args(argv)
    if a.table:
        print(markdown(load_results(a.out / f"{a.name}.json")))
        return
    mixers = list(MIXERS) if a.mixers == "all" else [
        m.strip() for m in a.mixers.split(",") if m.strip()]
    for m in mixers:
        if m not in MIXERS:
            raise SystemExit(f"--mixers: unknown mixer {m!r}; choose from {', '.join(MIXERS)}")
    sizes = [(16, 2)] if a.quick else parse_sizes(a.sizes)
    steps = 6 if a.quick else a.steps
    seeds = [int(s) for s in _floats(a.seeds, "--seeds")][: 1 if a.quick else None]
    widths = [int(w) for w in _floats(a.d_model, "--d-model")]
    out_json = a.out / f"{a.name}.json"
    results: list[dict[str, Any]] = []
    if out_json.exists():
        results = load_results(out_json)
    done = {run_key(r) for r in results}
    if a.lrs == "best":
        best = {c["mixer"]: c["lr"] for c in summarize(results) if c["best_lr"] and
                (c["T"], c["pairs"], c["d_model"]) == (*SWEEP_SIZE, D_MODEL)}
        missing = [m for m in mixers if m not in best]
        if missing:
            raise SystemExit(f"--lrs best: no sweep at {SWEEP_SIZE}, d_model {D_MODEL} in "
                             f"{out_json} for {', '.join(missing)}; run it first")
        lrs_of = {m: [best[m]] for m in mixers}
    else:
        lrs_of = dict.fromkeys(mixers, _floats(a.lrs, "--lrs"))
    if a.device != "cpu" and not (a.device.startswith("cuda") and torch.cuda.is_available()):
        raise SystemExit(f"--device: expected cpu, or cuda on a machine with a CUDA GPU, got "
                         f"{a.device!r} (CUDA available: {torch.cuda.is_available()})")
    deadline = None if a.budget_s is None else time.time() + a.budget_s
    jobs = []
    # Seeds outermost: a grid stopped early has every mixer and rate at the first seeds.
    for T, pairs in sizes:
        for d in widths:
            for seed in seeds:
                for m in mixers:
                    for lr in lrs_of[m]:
                        kw = dict(mixer=m, T=T, pairs=pairs, steps=steps,
                                  batch=max(1, TOKENS_PER_STEP // T), lr=lr, seed=seed, d=d,
                                  eval_every=2 if a.quick else a.eval_every,
                                  early_stop=None if a.no_early_stop else SOLVED,
                                  device=a.device, deadline=deadline)
                        if (m, T, pairs, d, steps, float(lr), seed) not in done:
                            jobs.append(kw)
    print(f"{len(jobs)} runs to do, {len(done)} already in {out_json}", flush=True)
    if a.seeds_together:
        jobs = together(jobs)
        print(f"  as {len(jobs)} jobs, each training its seeds together", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def report(finished: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Print a finished run (or a group's runs) and rewrite the JSON and PNG, keeping
        the runs that other processes stored in the same file meanwhile (parts of a grid
        may run at once)."""
        for r in finished if isinstance(finished, list) else [finished]:
            _report_one(r)

    def _report_one(r: dict[str, Any]) -> None:
        results.append(r)
        print(f"T={r['T']:4d} pairs={r['pairs']:3d} d={r['d_model']:3d} {r['mixer']:14s} "
              f"lr {r['lr']:.0e} seed {r['seed']}: acc {r['acc']:.3f} loss {r['loss']:.3f} "
              f"to-0.9 {r['steps_to_0.9']} ({r['seconds']:.0f} s)", flush=True)
        save_merged(out_json, results, run_key, load_results, lambda rs: {
            "task": "MQAR (Zoology protocol)", "vocab": VOCAB, "layers": LAYERS,
            "heads": HEADS, "conv_taps": CONV_TAPS, "eval_samples": EVAL_SAMPLES,
            "check_samples": CHECK_SAMPLES, "tokens_per_step": TOKENS_PER_STEP,
            "machine": {"python": sys.version.split()[0], "torch": torch.__version__,
                        "cpu": platform.processor() or platform.machine(),
                        "jobs": a.jobs, "threads_per_job": 1, "device": a.device,
                        "seeds_together": a.seeds_together,
                        "gpu": torch.cuda.get_device_name() if a.device != "cpu" else None},
            "summary": summarize(rs), "results": rs})
        plot(results, a.out / f"{a.name}.png")

    # CUDA cannot be used in a forked child: the GPU runs start fresh interpreters.
    run_parallel(_job, jobs, a.jobs, report, spawn=a.device != "cpu")
    print(f"wrote {out_json} and {a.out / (a.name + '.png')} "
          f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()

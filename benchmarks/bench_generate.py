"""Decode speed against context length: HLA with its state beside softmax with a KV cache.

At each context length L the model takes a prompt of L tokens, then decodes one token at
a time; the figure is tokens/s of the decode (1 / the median step time; the decoders
take turns step by step, so a change of load weighs on all alike). Three decoders of
equal width, depth, heads and MLP:

* ``hla2 (hla-sp generate)``: the megatron-core GPTModel of the trainer, decoded by
  :mod:`hla_sp.launch.export.generate` (real prefill, then one-token forwards with each
  layer's recurrent state): what the command runs;
* ``hla2 (plain torch)``: a plain PyTorch model whose layers are
  :class:`hla_sp.nn.HLAttention` (``step`` with its state), real prefill;
* ``softmax + KV cache (plain torch)``: the same plain model with softmax attention
  (``scaled_dot_product_attention`` over a preallocated cache). Its cache is filled with
  random keys and values: a step's cost depends on the cache's length, not its values,
  and a real softmax prefill of 16k tokens would dominate the run. Its decode is checked
  against its own full causal forward on a short sequence first.

HLA's step reads a state of fixed size, so its rate stays flat as L grows; softmax's
step reads L cached keys and values per layer, so its rate falls.

    python benchmarks/bench_generate.py            # -> runs/bench/generate.{json,png}
    python benchmarks/bench_generate.py --out benchmarks/results   # the committed figures
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hla_sp.nn import HLAttention

QUIET_LOAD = 0.5  # 1-minute load average under which a machine counts as quiet
GPT = "hla2 (hla-sp generate)"


class SoftmaxKV(nn.Module):
    """Causal softmax attention decoding with a preallocated KV cache [B, H, Lmax, d]."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.d = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.k_cache = self.v_cache = torch.zeros(0)
        self.length = 0

    def _split(self, x: torch.Tensor) -> list[torch.Tensor]:
        B, T, _ = x.shape
        return [t.view(B, T, self.heads, self.d).transpose(1, 2)
                for t in self.qkv(x).chunk(3, -1)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Whole sequence x [B, T, hidden], causal (the reference of the check)."""
        q, k, v = self._split(x)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(o.transpose(1, 2).reshape(x.shape))

    def fill(self, batch: int, length: int, capacity: int, gen: torch.Generator) -> None:
        """A cache of ``length`` random entries with room up to ``capacity``."""
        shape = (batch, self.heads, capacity, self.d)
        self.k_cache, self.v_cache = torch.zeros(shape), torch.zeros(shape)
        self.k_cache[:, :, :length] = torch.randn(batch, self.heads, length, self.d,
                                                  generator=gen)
        self.v_cache[:, :, :length] = torch.randn(batch, self.heads, length, self.d,
                                                  generator=gen)
        self.length = length

    def step(self, x: torch.Tensor) -> torch.Tensor:
        """One token x [B, 1, hidden]: append its key and value, attend to the cache."""
        q, k, v = self._split(x)
        n = self.length
        self.k_cache[:, :, n : n + 1] = k
        self.v_cache[:, :, n : n + 1] = v
        self.length = n + 1
        o = F.scaled_dot_product_attention(q, self.k_cache[:, :, : n + 1],
                                           self.v_cache[:, :, : n + 1])
        return self.o(o.transpose(1, 2).reshape(x.shape))


class HLAState(nn.Module):
    """:class:`HLAttention` decoding with its state (plain torch)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.attn = HLAttention(hidden, heads, operator="hla2")
        self.state: tuple | None = None

    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        y, self.state = self.attn(x, output_final_state=True)
        return y

    def step(self, x: torch.Tensor) -> torch.Tensor:
        y, self.state = self.attn.step(x, self.state)
        return y


class PlainLM(nn.Module):
    """Pre-norm GPT: embedding, layers of (mixer, MLP), final norm, tied output."""

    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, ffn: int, mixer: str):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        make = SoftmaxKV if mixer == "softmax" else HLAState
        self.mixers = nn.ModuleList(make(hidden, heads) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(2 * layers + 1))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(),
                                                nn.Linear(ffn, hidden)) for _ in range(layers))

    def run(self, tokens: torch.Tensor, how: str) -> torch.Tensor:
        """Logits [B, T, vocab]; ``how``: forward (whole, no cache), prefill or step."""
        h = self.embed(tokens)
        for i, (mixer, mlp) in enumerate(zip(self.mixers, self.mlps)):
            h = h + getattr(mixer, how)(self.norms[2 * i](h))
            h = h + mlp(self.norms[2 * i + 1](h))
        return self.norms[-1](h) @ self.embed.weight.T


def timed_round_robin(steps_of: dict[str, Callable[[torch.Tensor], torch.Tensor]],
                      first: dict[str, torch.Tensor], warmup: int, steps: int
                      ) -> dict[str, list[float]]:
    """Seconds of each of ``steps`` greedy decode steps per decoder, after ``warmup``
    untimed ones; the decoders take turns, step by step, so that a change in the
    machine's load weighs on all of them alike."""
    tok, out = dict(first), {name: [] for name in steps_of}
    for _ in range(warmup + steps):
        for name, step in steps_of.items():
            t = time.perf_counter()
            logits = step(tok[name])
            out[name].append(time.perf_counter() - t)
            tok[name] = logits[:, -1:].argmax(-1)
    return {name: times[warmup:] for name, times in out.items()}


def check_softmax_cache(model: PlainLM, gen: torch.Generator) -> float:
    """Max |decode with the cache - full causal forward| over 24 tokens (fp32)."""
    x = torch.randint(0, model.embed.num_embeddings, (1, 24), generator=gen)
    full = model.run(x, "forward")
    for m in model.mixers:
        m.fill(1, 0, 24, gen)
    steps = torch.cat([model.run(x[:, t : t + 1], "step") for t in range(24)], 1)
    return float((steps - full).abs().max())


def build_gpt(args: argparse.Namespace, vocab: int) -> torch.nn.Module:
    """The trainer's GPTModel (hla2, its default options) at this width."""
    from hla_sp.launch.config.train_config import parse_args
    from hla_sp.launch.model.build import build_model

    cfg = parse_args(["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
                      "--num-attention-heads", str(args.heads), "--ffn-hidden-size",
                      str(args.ffn), "--seq-length", str(max(args.contexts) + 64),
                      "--position-embedding-type", "none", "--attention", "hla2"])
    torch.manual_seed(0)
    return build_model(cfg, vocab).eval()


def prefill_gpt(dec, L: int, gen: torch.Generator):
    """The prompt through hla_sp.launch.export.generate's decoder: (first token, seconds)."""
    prompt = torch.randint(0, 257, (1, L), generator=gen)
    t = time.perf_counter()
    first = dec.advance(prompt)[:, -1:].argmax(-1)
    return first, time.perf_counter() - t


def prefill_plain(model: PlainLM, L: int, capacity: int, gen: torch.Generator):
    """The prompt through a plain model (softmax: a filled cache): (first token, seconds)."""
    prompt = torch.randint(0, model.embed.num_embeddings, (1, L), generator=gen)
    t = time.perf_counter()
    if isinstance(model.mixers[0], SoftmaxKV):
        for m in model.mixers:  # random entries: see the module docstring
            m.fill(1, L, capacity, gen)
        first = prompt[:, -1:]
    else:
        first = model.run(prompt, "prefill")[:, -1:].argmax(-1)
    return first, time.perf_counter() - t


def bench_context(gpt: torch.nn.Module, plain: dict[str, PlainLM], args: argparse.Namespace,
                  L: int, gen: torch.Generator) -> dict[str, dict]:
    """Prefill L tokens in every decoder, then time their decode steps in turns."""
    from hla_sp.launch.export.generate import Decoder

    with torch.no_grad(), Decoder(gpt) as dec:
        first, prefill = {}, {}
        first[GPT], prefill[GPT] = prefill_gpt(dec, L, gen)
        steps_of = {GPT: dec.advance}
        for name, model in plain.items():
            first[name], prefill[name] = prefill_plain(model, L, L + args.warmup + args.steps,
                                                       gen)
            steps_of[name] = functools.partial(model.run, how="step")
        times = timed_round_robin(steps_of, first, args.warmup, args.steps)
    return {name: {"prefill_s": prefill[name], "step_s": times[name]} for name in steps_of}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, rows in result["decoders"].items():
        xs = [r["context"] for r in rows]
        ax.plot(xs, [r["tokens_per_s"] for r in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("context length (prompt tokens)")
    ax.set_ylabel("decode tokens/s (batch 1)")
    m = result["model"]
    mach = result["machine"]
    quiet = "" if mach["quiet"] else f", not quiet (load {mach['load_average_before'][0]:.0f})"
    ax.set_title(f"{m['layers']} layers x {m['hidden']} hidden, {m['heads']} heads, CPU "
                 f"{result['threads']} thread{'s' if result['threads'] > 1 else ''}{quiet}",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench", help="Directory of generate.{json,png}.")
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096, 16384, 65536])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32, help="Timed decode steps per point.")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    from hla_sp.launch.export.generate import single_process
    from hla_sp.launch.model.build import padded_vocab_size

    vocab = padded_vocab_size(257, 128, 1)  # the trainer's byte vocabulary, padded
    load = os.getloadavg()
    t_all = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    plain = {name: PlainLM(vocab, args.hidden, args.heads, args.layers, args.ffn, mixer).eval()
             for name, mixer in (("hla2 (plain torch)", "hla2"),
                                 ("softmax + KV cache (plain torch)", "softmax"))}
    with torch.no_grad():
        check = check_softmax_cache(plain["softmax + KV cache (plain torch)"], gen)
    assert check < 1e-4, f"the softmax KV-cache decode differs from its forward by {check}"
    decoders: dict[str, list[dict]] = {GPT: [], **{n: [] for n in plain}}
    with single_process():
        gpt = build_gpt(args, vocab)
        for L in args.contexts:
            for name, r in bench_context(gpt, plain, args, L, gen).items():
                med = statistics.median(r["step_s"])
                decoders[name].append({"context": L, "tokens_per_s": 1.0 / med,
                                       "median_step_ms": 1e3 * med, **r})
                print(f"L={L:>6}  {name:<34} {1 / med:8.1f} tokens/s  "
                      f"(prefill {r['prefill_s']:.2f} s)", flush=True)
    result = {
        "what": "decode tokens/s (batch 1, greedy) after a prompt of `context` tokens",
        "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                  "ffn": args.ffn, "vocab": vocab, "hla": "hla2, the trainer's defaults"},
        "threads": args.threads, "steps": args.steps, "warmup": args.warmup,
        "softmax_cache_check_max_abs": check,
        "softmax_cache_fill": "random keys and values (a step's cost depends on the length)",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "load_average_before": load, "load_average_after": os.getloadavg(),
                    "niceness": os.nice(0), "quiet": load[0] < QUIET_LOAD},
        "wall_s": time.perf_counter() - t_all,
        "decoders": decoders,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "generate.json").write_text(json.dumps(result, indent=1) + "\n")
    try:
        plot(result, out / "generate.png")
    except ImportError:
        print("bench_generate: no matplotlib, no figure", file=sys.stderr)
    print(f"bench_generate: {result['wall_s']:.0f} s; wrote {out / 'generate.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

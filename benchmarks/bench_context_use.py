"""Do small byte-level models trained short use a long context? Loss by position, passkey.

The models are ``bench_lm``'s (the same blocks as the recall study: hla2, linear,
gated-linear and softmax with rotary positions), trained at T = 256 on the first 2M
bytes of the standard library's sources and kept with ``--save-models``:

    python benchmarks/bench_lm.py --mixers hla2,linear,gated-linear,softmax-rope \
        --seeds 0,1 --save-models runs/ctx/models --out runs/ctx --name ctx_lm

This script scores each kept model, on text no model has seen (past the 2M training
bytes), with the measurements of ``hla-sp eval`` (:mod:`hla_sp.launch.eval.tasks`: the
same log-spaced position buckets, the same passkey prompts and scoring):

- ``ppl``: the loss per position bucket ([0, 256), [256, 512), ... up to --ppl-length,
  default 64k) over --ppl-samples windows, in bits per byte;
- ``passkey``: a 5-digit key hidden at each depth of filler text and asked for at the
  end, scored under teacher forcing: the key retrieved when every digit is the argmax,
  and the fraction of digits that are.

    python benchmarks/bench_context_use.py --models runs/ctx/models \
        --out benchmarks/results [--name context_use]

Writes ``<name>.json`` (every model's figures) and ``<name>.png`` (loss by position per
mixer, every seed; passkey digit accuracy by length).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_recall import RecallLM
from hla_sp.launch.data.datasets import ArrayTokens, builtin_text_tokens
from hla_sp.launch.data.tokenizer import load_tokenizer
from hla_sp.launch.eval.tasks import TextWindows, bucket_of, buckets, passkey

TRAIN_BYTES = 2_000_000  # bench_lm's corpus: the windows start past it


def load(path: Path) -> tuple[RecallLM, dict[str, Any]]:
    """A model kept by ``bench_lm --save-models`` and its record."""
    rec = torch.load(path, map_location="cpu", weights_only=False)
    model = RecallLM(rec["mixer"], rec["T"], d=rec["d"], layers=rec["layers"],
                     heads=rec["heads"], vocab=rec["vocab"])
    model.load_state_dict(rec["state_dict"])
    return model.eval(), rec


@torch.no_grad()
def ppl_by_position(model: RecallLM, windows: TextWindows, length: int, samples: int,
                    first: int) -> list[dict[str, Any]]:
    """Bits per byte in each bucket of :func:`buckets` over ``samples`` windows."""
    edges = buckets(length, first)
    sums = torch.zeros(len(edges), dtype=torch.float64)
    counts = torch.zeros(len(edges), dtype=torch.float64)
    for i in range(samples):
        w = torch.from_numpy(windows.window(i, length))[None]  # [1, length + 1]
        nll = F.cross_entropy(model(w[:, :-1])[0].double(), w[0, 1:], reduction="none")
        which = bucket_of(torch.arange(length), first)
        sums.index_add_(0, which, nll)
        counts.index_add_(0, which, torch.ones_like(nll))
    return [{"lo": lo, "hi": hi, "bits_per_byte": float(s / c) / math.log(2)}
            for (lo, hi), s, c in zip(edges, sums, counts)]


@torch.no_grad()
def passkey_scores(model: RecallLM, lengths: list[int], depths: list[float], samples: int,
                   seed: int) -> list[dict[str, Any]]:
    """Per (length, depth): keys retrieved (every digit the argmax) and digits right."""
    tok = load_tokenizer(None)
    rows = []
    for length in lengths:
        for d, depth in enumerate(depths):
            keys = digits = 0
            for i in range(samples):
                pk = passkey(tok, length, depth, seed, d, i)
                x = torch.from_numpy(pk.tokens)[None]
                logits = model(x[:, :-1])[0, -pk.answer_tokens:]
                right = int((logits.argmax(-1) == x[0, -pk.answer_tokens:]).sum())
                keys += right == pk.answer_tokens
                digits += right
            rows.append({"length": length, "depth": depth, "samples": samples,
                         "key_accuracy": keys / samples,
                         "digit_accuracy": digits / (samples * pk.answer_tokens)})
    return rows


def summary(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mixer: the mean and spread over seeds of each bucket and of the digit accuracy
    by length."""
    out = []
    for mixer in dict.fromkeys(r["mixer"] for r in results):
        runs = [r for r in results if r["mixer"] == mixer]
        row: dict[str, Any] = {"mixer": mixer, "seeds": [r["seed"] for r in runs],
                               "buckets": [], "passkey": []}
        for j, b in enumerate(runs[0]["ppl"]):
            xs = [r["ppl"][j]["bits_per_byte"] for r in runs]
            row["buckets"].append({"lo": b["lo"], "hi": b["hi"], "mean": statistics.fmean(xs),
                                   "min": min(xs), "max": max(xs)})
        for length in dict.fromkeys(p["length"] for p in runs[0]["passkey"]):
            keys = [p["key_accuracy"] for r in runs for p in r["passkey"] if p["length"] == length]
            dig = [p["digit_accuracy"] for r in runs for p in r["passkey"]
                   if p["length"] == length]
            row["passkey"].append({"length": length, "key_accuracy": statistics.fmean(keys),
                                   "digit_accuracy": statistics.fmean(dig)})
        out.append(row)
    return out


def markdown(record: dict[str, Any]) -> str:
    """The loss by bucket and the passkey digits per mixer (every seed) as markdown."""
    rows = record["results"]
    edges = [(b["lo"], b["hi"]) for b in rows[0]["ppl"]]
    lengths = sorted({p["length"] for p in rows[0]["passkey"]})

    def k(n: int) -> str:
        return f"{n // 1024}k" if n >= 1024 else str(n)

    out = ["| mixer | seed | " + " | ".join(f"{k(lo)}-{k(hi)}" for lo, hi in edges)
           + " | " + " | ".join(f"digits at {k(n)}" for n in lengths) + " |",
           "|---|---|" + "---|" * (len(edges) + len(lengths))]
    for r in sorted(rows, key=lambda r: (r["mixer"], r["seed"])):
        dig = [statistics.fmean(p["digit_accuracy"] for p in r["passkey"] if p["length"] == n)
               for n in lengths]
        out.append(f"| {r['mixer']} | {r['seed']} | "
                   + " | ".join(f"{b['bits_per_byte']:.3f}" for b in r["ppl"]) + " | "
                   + " | ".join(f"{d:.2f}" for d in dig) + " |")
    return "\n".join(out)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors: dict[str, Any] = {}
    for r in results:
        mids = [math.sqrt(max(x["lo"], 1) * x["hi"]) for x in r["ppl"]]
        line, = a.plot(mids, [x["bits_per_byte"] for x in r["ppl"]], marker="o", ms=3, lw=1,
                       color=colors.get(r["mixer"]),
                       label=None if r["mixer"] in colors else r["mixer"])
        colors.setdefault(r["mixer"], line.get_color())
        lengths = sorted({p["length"] for p in r["passkey"]})
        acc = [statistics.fmean(p["digit_accuracy"] for p in r["passkey"] if p["length"] == n)
               for n in lengths]
        b.plot(lengths, acc, marker="o", ms=3, lw=1, color=colors[r["mixer"]])
    a.axvline(results[0]["T"], color="grey", lw=0.8, ls="--")
    a.set(xscale="log", xlabel="position (bytes; dashed: the training length)",
          ylabel="loss (bits / byte)", title="Loss by position, held-out text (every seed)")
    b.axhline(0.1, color="grey", lw=0.8, ls=":")
    b.set(xscale="log", xlabel="passkey sequence length (bytes)",
          ylabel="digits right (argmax)", title="Passkey digits (dotted: chance)", ylim=(0, 1))
    a.grid(alpha=0.3)
    b.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: expected a comma list of ints, got {text!r}") from None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=Path, default=Path("runs/ctx/models"),
                    help="directory of bench_lm --save-models files")
    ap.add_argument("--ppl-length", type=int, default=65536)
    ap.add_argument("--ppl-samples", type=int, default=2)
    ap.add_argument("--passkey-lengths", default="256,1024,4096,16384")
    ap.add_argument("--depths", default="0,0.5,1")
    ap.add_argument("--passkey-samples", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("runs/bench_context_use"))
    ap.add_argument("--name", default="context_use")
    ap.add_argument("--table", action="store_true",
                    help="print <out>/<name>.json as markdown; score nothing")
    a = ap.parse_args(argv)
    if a.table:
        print(markdown(json.loads((a.out / f"{a.name}.json").read_text())))
        return
    paths = sorted(a.models.glob("*.pt"))
    if not paths:
        raise SystemExit(f"--models {a.models}: no .pt files (bench_lm.py --save-models DIR)")
    lengths = _ints(a.passkey_lengths, "--passkey-lengths")
    try:
        depths = [float(x) for x in a.depths.split(",")]
    except ValueError:
        raise SystemExit(f"--depths: expected a comma list of fractions, got {a.depths!r}"
                         ) from None
    torch.set_num_threads(a.threads)
    stream = builtin_text_tokens(TRAIN_BYTES + a.ppl_samples * (a.ppl_length + 1))
    windows = TextWindows(ArrayTokens(stream), TRAIN_BYTES, a.ppl_length + 1,
                          "standard library past bench_lm's 2M training bytes")
    a.out.mkdir(parents=True, exist_ok=True)
    results = []
    for path in paths:
        t0 = time.perf_counter()
        model, rec = load(path)
        r = {"mixer": rec["mixer"], "seed": rec["seed"], "T": rec["T"], "steps": rec["steps"],
             "valid_bpb_at_T": rec["valid_loss"] / math.log(2),
             "ppl": ppl_by_position(model, windows, a.ppl_length, a.ppl_samples, rec["T"]),
             "passkey": passkey_scores(model, lengths, depths, a.passkey_samples, a.seed)}
        r["seconds"] = time.perf_counter() - t0
        results.append(r)
        last = r["ppl"][-1]
        dig = statistics.fmean(p["digit_accuracy"] for p in r["passkey"])
        print(f"{r['mixer']:14s} seed {r['seed']}: {r['ppl'][0]['bits_per_byte']:.3f} bits/byte "
              f"in [0, {r['ppl'][0]['hi']}), {last['bits_per_byte']:.3f} in [{last['lo']}, "
              f"{last['hi']}); passkey digits {dig:.2f}  ({r['seconds']:.0f} s)", flush=True)
        record = {"task": "context use of byte-level models trained at T", "windows":
                  windows.source, "ppl_length": a.ppl_length, "ppl_samples": a.ppl_samples,
                  "passkey_lengths": lengths, "depths": depths,
                  "passkey_samples": a.passkey_samples, "torch": torch.__version__,
                  "summary": summary(results), "results": results}
        (a.out / f"{a.name}.json").write_text(json.dumps(record, indent=1))
        plot(results, a.out / f"{a.name}.png")
    print(f"wrote {a.out / (a.name + '.json')} and {a.out / (a.name + '.png')}")


if __name__ == "__main__":
    main()

"""Read a Megatron-LM training log (benchmarks/gpu_megatron.sh) into tokens/s and MFU.

Megatron logs one line per iteration ("... elapsed time per iteration (ms): X |
throughput per GPU (TFLOP/s/GPU): Y | ... lm loss: Z"). Its TFLOP/s counts every
layer's attention as softmax's (quadratic in T); here the model FLOPs are
:func:`hla_sp.launch.model.flops.gpt_flops_per_token` of the run's shape and attention
(HLA's chunked passes, linear in T), and MFU is the per-GPU rate over the device's
dense bf16 peak (``hla_sp.launch.train.throughput.PEAK_TFLOPS``; ``--peak-tflops`` overrides).

    python benchmarks/megatron_log.py --log megatron.log --attention hla2 --seq 8192 \\
        --gbs 4 --layers 8 --hidden 1024 --heads 8 --kv-groups 4 --vocab 32000 --out m.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from hla_sp.launch.model.flops import gpt_flops_per_token
from hla_sp.launch.train.throughput import default_peak

ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)"
                  r"(?:.*?TFLOP/s/GPU\): ([0-9.]+))?(?:.*?lm loss: ([0-9.Ee+-]+))?")
GPU = re.compile(r"^gpu: (.+)$", re.MULTILINE)


def parse(text: str) -> list[dict[str, float | None]]:
    """Iteration records in order: ms, Megatron's TFLOP/s, lm loss (None if absent)."""
    rows = {}
    for it, ms, tf, loss in ITER.findall(text):
        rows[int(it)] = dict(iteration=int(it), ms=float(ms), megatron_tflops=float(tf)
                             if tf else None, loss=float(loss) if loss else None)
    return [rows[i] for i in sorted(rows)]


def summarize(text: str, *, attention: str, seq: int, gbs: int, layers: int, hidden: int,
              heads: int, kv_groups: int, ffn: int, vocab: int, warmup: int = 2,
              peak_tflops: float | None = None) -> dict[str, Any]:
    """tokens/s (median step after ``warmup`` iterations), model TFLOP/s per GPU by the
    linear-attention-aware count, MFU, and Megatron's own TFLOP/s beside them."""
    rows = parse(text)
    gpu = GPU.search(text)
    device = gpu.group(1).strip() if gpu else None
    peak = peak_tflops or default_peak(device, half=True)
    out: dict[str, Any] = dict(attention=attention, seq=seq, gbs=gbs, layers=layers,
                               hidden=hidden, heads=heads, kv_groups=kv_groups, ffn=ffn,
                               vocab=vocab, device=device, iterations=len(rows),
                               peak_tflops=peak, losses=[r["loss"] for r in rows])
    timed = rows[warmup:]
    if not timed:
        return out | dict(error=f"{len(rows)} iteration lines, fewer than warm-up + 1")
    ms = statistics.median(r["ms"] for r in timed)
    tokens = gbs * seq
    flops = gpt_flops_per_token(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_groups,
                                ffn=ffn, vocab=vocab, seq_length=seq, attention=attention)
    tflops = flops * tokens / (ms / 1e3) / 1e12
    megatron = [r["megatron_tflops"] for r in timed if r["megatron_tflops"] is not None]
    return out | dict(ms_per_iter=ms, tokens_per_s=tokens / (ms / 1e3),
                      model_flops_per_token=flops, model_tflops_per_gpu=tflops,
                      mfu=tflops / peak if peak else None,
                      megatron_tflops_per_gpu=statistics.median(megatron) if megatron else None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--log", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--attention", required=True)
    for flag in ("seq", "gbs", "layers", "hidden", "heads", "kv-groups", "vocab"):
        p.add_argument(f"--{flag}", type=int, required=True)
    p.add_argument("--ffn", type=int, default=None, help="default 4 x hidden")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=None)
    a = p.parse_args()
    text = a.log.read_text(errors="replace") if a.log.exists() else ""
    res = summarize(text, attention=a.attention, seq=a.seq, gbs=a.gbs, layers=a.layers,
                    hidden=a.hidden, heads=a.heads, kv_groups=a.kv_groups,
                    ffn=a.ffn or 4 * a.hidden, vocab=a.vocab, warmup=a.warmup,
                    peak_tflops=a.peak_tflops)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "losses"}))
    return 0 if "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())

"""What ``hla-sp eval`` writes: the JSON record, one line per length, and the plot."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from hla_sp.launch import checkpoint
from hla_sp.launch.data.indexed_dataset import BYTE_VOCAB
from hla_sp.launch.eval.command import output_paths
from hla_sp.launch.eval.tasks import short
from hla_sp.launch.extras import pyplot


def header(plan: Any, topo: Any, command: str) -> dict[str, Any]:
    """The record before any figure: the command, the checkpoint, the model, the layout
    and the text or prompts the figures come from."""
    import torch

    args, cfg = plan.args, plan.cfg
    rec: dict[str, Any] = {
        "task": args.task,
        "command": command,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load": os.path.abspath(args.load),
        "checkpoint": os.path.abspath(checkpoint.checkpoint_dir(args.load, plan.iteration)),
        "iteration": plan.iteration,
        "model": {"attention": cfg.model.attention, "num_layers": cfg.model.num_layers,
                  "hidden_size": cfg.model.hidden_size,
                  "num_attention_heads": cfg.model.num_attention_heads,
                  "position_embedding_type": cfg.model.position_embedding_type,
                  "vocab_size": cfg.model.vocab_size or BYTE_VOCAB,
                  "bf16": cfg.precision.bf16, "fp16": cfg.precision.fp16},
        "lengths": plan.lengths,
        "samples": args.samples,
        "context_parallel_size": plan.cp,
        "device": topo.device.type,
        "threads_per_rank": torch.get_num_threads(),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "timing": {},
        "results": [],
    }
    if args.task == "ppl-by-position":
        rec["data"] = {"source": plan.data.source, "start_token": plan.data.start,
                       "stride": plan.data.stride,
                       "rule": "window i at every length is tokens [start + i * stride, "
                               "+ length + 1) of the stream (documents joined with EOD); "
                               "the loss at position t predicts token t + 1"}
        rec["first_bucket"] = args.first_bucket
    else:
        rec["depths"] = plan.depths
        rec["seed"] = args.seed
    return rec


def write_json(plan: Any, record: dict[str, Any]) -> str:
    """Write the record (whole, or the previous one stays); return its path."""
    path = output_paths(plan.args)[0]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def _k(n: int) -> str:
    return short(n) if n else "0"


def line(plan: Any, out: dict[str, Any]) -> str:
    """One length's result for the console."""
    cost = (f"{out['seconds']:.1f} s, {out['seconds_per_1k_tokens']:.3f} s per 1k tokens, "
            f"peak {out['peak_mem_bytes'] / 2**30:.2f} GiB per rank")
    head = f"length {short(out['length'])}"
    if plan.args.task == "ppl-by-position":
        parts = ", ".join(f"{_k(b['lo'])}-{_k(b['hi'])} {b['bits_per_token']:.3f}"
                          for b in out["buckets"])
        return (f"{head}: {out['loss_nats']:.4f} nats = {out['bits_per_token']:.4f} bits per "
                f"token; bits by position {parts} ({cost})")
    parts = ", ".join(f"{r['depth']:g}: {r['accuracy']:.2f} ({r['digit_logprob']:.2f})"
                      for r in out["depths"])
    return (f"{head}: passkey accuracy {out['accuracy']:.2f}; by depth (mean digit "
            f"log-prob) {parts} ({cost})")


def plot(plan: Any, record: dict[str, Any]) -> str:
    """The PNG: bits per token against position (one line per length), or the passkey
    accuracy by length and depth; returns its path."""
    plt = pyplot()
    path = output_paths(plan.args)[1]
    results = record["results"]
    if plan.args.task == "ppl-by-position":
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for r in results:
            # each bucket at its geometric middle (the first one from position 1)
            xs = [math.sqrt(max(b["lo"], 1) * b["hi"]) for b in r["buckets"]]
            ax.plot(xs, [b["bits_per_token"] for b in r["buckets"]], marker="o",
                    label=f"length {short(r['length'])}")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="position (bucket middle, tokens)", ylabel="bits per token",
               title=f"Loss by position, iteration {record['iteration']}")
        ax.legend()
    else:
        fig, ax = plt.subplots(figsize=(1.2 * len(plan.depths) + 2.5,
                                        0.6 * len(results) + 2))
        acc = [[d["accuracy"] for d in r["depths"]] for r in results]
        im = ax.imshow(acc, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        for i, r in enumerate(results):
            for j, d in enumerate(r["depths"]):
                ax.text(j, i, f"{d['accuracy']:.2f}\n{d['digit_logprob']:.2f}", ha="center",
                        va="center", color="w" if d["accuracy"] < 0.5 else "k", fontsize=8)
        ax.set_xticks(range(len(plan.depths)), [f"{d:g}" for d in plan.depths])
        ax.set_yticks(range(len(results)), [short(r["length"]) for r in results])
        ax.set(xlabel="depth of the key", ylabel="length (tokens)",
               title=f"Passkey accuracy (mean digit log-prob), iteration {record['iteration']}")
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def finish(plan: Any, record: dict[str, Any]) -> list[str]:
    """The closing lines: the plot drawn, both files named."""
    from hla_sp.launch.eval.verdict import passkey_verdict

    json_path = write_json(plan, record)
    png = plot(plan, record)
    verdict = passkey_verdict(record)
    return [*([verdict] if verdict else []),
            f"eval: {os.path.abspath(json_path)} (every figure), {os.path.abspath(png)} "
            f"(the plot); {record['timing']['total_s']:.1f} s in all"]

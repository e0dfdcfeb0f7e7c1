"""Long-context memory and throughput of the trainer on CPU (gloo), per rank.

Three measurements, each a real ``torchrun -m hla_sp.launch.train`` run whose JSONL
gives tokens/s and the per-rank peak memory (resident-set high-water mark on CPU,
allocator peak on GPU; it includes about 0.5 GiB of interpreter, torch and megatron):

1. ``lengths``: fixed CP (default 4), T in {256k, 512k, 1M};
2. ``per_rank``: fixed tokens per rank (default 64k) as CP grows over {1, 2, 4};
3. ``sizes``: the largest model that fits a memory budget (default 24 GiB) per rank at
   T = 1M over CP = 4. Each width is measured on one process at two lengths (a rank
   of a CP group holds T/CP tokens and the same activations as one process on T/CP
   tokens, plus a few summary matrices; ``per_rank`` checks this), the per-token slope
   and the fixed part are fitted, and the peak at 1M / CP = 4 is projected from them.

Writes ``long_context.json`` and ``long_context.png`` to ``--out`` (default
``runs/bench``; ``--out benchmarks/results`` refreshes the committed figures).

    python benchmarks/bench_long_context.py                       # everything (~15 min)
    python benchmarks/bench_long_context.py --only sizes per_rank # a part
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

from hla_sp.launch.distributed.local import run_local

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 2**30


def model_flags(hidden: int, layers: int, head_dim: int = 16) -> list[str]:
    """A small HLA2 GPT: byte vocabulary unpadded, no position table, full recompute."""
    return [
        "--num-layers", str(layers), "--hidden-size", str(hidden),
        "--num-attention-heads", str(max(1, hidden // head_dim)),
        "--position-embedding-type", "none", "--make-vocab-size-divisible-by", "1",
        "--recompute-granularity", "full", "--attention", "hla2", "--lr", "3e-3",
    ]  # fmt: skip


# glibc raises its mmap threshold after large frees, so later large tensors come from the
# heap and the resident set stays high after they are freed; a fixed threshold returns
# every large tensor to the system when it is freed, and the peak RSS is the real peak
# (hla-sp train's own policy, hla_sp.launch.distributed.allocator, keeps freed blocks for reuse).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def measure(flags: list[str], nproc: int, iters: int, tag: str, tmp: str) -> dict[str, Any]:
    """One run; the figures of its last iteration (the first also allocates)."""
    run = run_local(
        [*flags, "--train-iters", str(iters), "--log-interval", "1"],
        nproc,
        os.path.join(tmp, f"{tag}.jsonl"),
        timeout=3600,
        env=MALLOC_ENV,
    )
    if run.returncode != 0 or not run.records:
        tail = run.output[-1500:]
        print(f"[{tag}] FAILED rc={run.returncode}\n{tail}", flush=True)
        return {"tag": tag, "status": "failed", "returncode": run.returncode, "tail": tail}
    last = run.records[-1]
    out = {
        "tag": tag,
        "status": "ok",
        "nproc": nproc,
        "seq_length": last["seq_length"],
        "cp": last["cp"],
        "tokens_per_rank": last["seq_length"] // last["cp"],
        "tokens_per_s": last["tokens_per_s"],
        "step_time_s": last["step_time_s"],
        "peak_mem_bytes_per_rank": last["peak_mem_bytes_per_rank"],
        "peak_mem_gib_max": max(last["peak_mem_bytes_per_rank"]) / GIB,
        "losses": run.losses,
        "wall_s": run.seconds,
    }
    print(
        f"[{tag}] T={out['seq_length']:,} CP={out['cp']}: {out['tokens_per_s']:,.0f} tok/s, "
        f"step {out['step_time_s']:.1f} s, peak/rank "
        f"{[round(m / GIB, 2) for m in out['peak_mem_bytes_per_rank']]} GiB, "
        f"loss {' -> '.join(f'{v:.3f}' for v in run.losses)}",
        flush=True,
    )
    return out


def lengths(args: argparse.Namespace, tmp: str) -> list[dict[str, Any]]:
    flags = model_flags(args.hidden, args.layers)
    return [
        measure(
            [*flags, "--seq-length", str(t), "--context-parallel-size", str(args.cp)],
            args.cp,
            args.iters,
            f"lengths_T{t}",
            tmp,
        )
        for t in args.lengths
    ]


def per_rank(args: argparse.Namespace, tmp: str) -> list[dict[str, Any]]:
    flags = model_flags(args.hidden, args.layers)
    return [
        measure(
            [
                *flags,
                "--seq-length",
                str(args.tokens_per_rank * cp),
                "--context-parallel-size",
                str(cp),
            ],
            cp,
            args.iters,
            f"per_rank_CP{cp}",
            tmp,
        )
        for cp in args.cps
    ]


def sizes(args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    """Fit peak = fixed + slope * tokens for each width; project to T/CP of the target."""
    target_tokens = args.target_seq // args.target_cp
    rows = []
    for hidden in args.hiddens:
        pts = [
            measure(
                [*model_flags(hidden, args.layers), "--seq-length", str(t)],
                1,
                1,  # the peak is reached in the first step (Adam's state is small)
                f"size_h{hidden}_T{t}",
                tmp,
            )
            for t in args.size_lengths
        ]
        ok = [p for p in pts if p["status"] == "ok"]
        row: dict[str, Any] = {"hidden": hidden, "layers": args.layers, "points": pts}
        if len(ok) == 2:
            (t0, m0), (t1, m1) = [(p["seq_length"], max(p["peak_mem_bytes_per_rank"])) for p in ok]
            slope = (m1 - m0) / (t1 - t0)
            fixed = m0 - slope * t0
            row.update(
                bytes_per_token=slope,
                fixed_bytes=fixed,
                projected_peak_gib=(fixed + slope * target_tokens) / GIB,
            )
            print(
                f"[sizes] hidden {hidden}: {slope:,.0f} B/token + {fixed / GIB:.2f} GiB -> "
                f"{row['projected_peak_gib']:.1f} GiB/rank at T={args.target_seq:,}, "
                f"CP={args.target_cp}",
                flush=True,
            )
        rows.append(row)
    fits = [r["hidden"] for r in rows if r.get("projected_peak_gib", 1e9) <= args.budget_gib]
    return {
        "target_seq": args.target_seq,
        "target_cp": args.target_cp,
        "budget_gib": args.budget_gib,
        "rows": rows,
        "largest_hidden_that_fits": max(fits) if fits else None,
    }


def width_fit(
    sizes_result: dict[str, Any], head_dim: int = 16, cp_factor: float = 1.0
) -> dict[str, Any] | None:
    """Bytes per token grow linearly with the width: fit ``a * hidden + b`` over the
    measured widths and find the widest model (a multiple of the head dim) whose
    projected peak at the target, times ``cp_factor`` (measured CP run / projection),
    fits the budget."""
    rows = [r for r in sizes_result.get("rows", []) if "bytes_per_token" in r]
    if len(rows) < 2:
        return None
    xs = [float(r["hidden"]) for r in rows]
    ys = [float(r["bytes_per_token"]) for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    b = my - a * mx
    fixed = max(float(r["fixed_bytes"]) for r in rows)
    tokens = sizes_result["target_seq"] // sizes_result["target_cp"]
    budget = sizes_result["budget_gib"] * GIB
    widest = None
    h = head_dim
    while (fixed + (a * h + b) * tokens) * cp_factor <= budget:
        widest = h
        h += head_dim
    return {
        "bytes_per_token_per_hidden": a,
        "bytes_per_token_intercept": b,
        "fixed_bytes": fixed,
        "widest_hidden_within_budget": widest,
        "cp_factor": cp_factor,
        "projected_peak_gib_at_widest": (fixed + (a * widest + b) * tokens) * cp_factor / GIB
        if widest
        else None,
    }


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    ok = [r for r in result.get("lengths", []) if r["status"] == "ok"]
    if ok:
        ax = axes[0]
        ax.plot([r["seq_length"] for r in ok], [r["peak_mem_gib_max"] for r in ok], "o-")
        ax.set(xscale="log", xlabel="T (tokens)", ylabel="peak GiB per rank",
               title=f"CP={ok[0]['cp']}, T grows")  # fmt: skip
    ok = [r for r in result.get("per_rank", []) if r["status"] == "ok"]
    if ok:
        ax = axes[1]
        ax.plot([r["cp"] for r in ok], [r["peak_mem_gib_max"] for r in ok], "o-", label="memory")
        ax.set(xlabel="CP", ylabel="peak GiB per rank",
               title=f"{ok[0]['tokens_per_rank']:,} tokens per rank")  # fmt: skip
        ax.set_ylim(bottom=0)
    rows = [r for r in result.get("sizes", {}).get("rows", []) if "projected_peak_gib" in r]
    if rows:
        ax = axes[2]
        s = result["sizes"]
        ax.plot([r["hidden"] for r in rows], [r["projected_peak_gib"] for r in rows], "o-")
        ax.axhline(s["budget_gib"], color="r", ls="--", label=f"{s['budget_gib']} GiB")
        ax.set(xlabel="hidden size", ylabel="projected peak GiB per rank",
               title=f"T={s['target_seq']:,}, CP={s['target_cp']}")  # fmt: skip
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", default=["lengths", "per_rank", "sizes"])
    ap.add_argument("--hidden", type=int, default=32, help="Width for lengths/per_rank.")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--lengths", type=int, nargs="+", default=[262144, 524288, 1048576])
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--tokens-per-rank", type=int, default=65536)
    ap.add_argument("--hiddens", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--size-lengths", type=int, nargs=2, default=[16384, 65536])
    ap.add_argument("--target-seq", type=int, default=1048576)
    ap.add_argument("--target-cp", type=int, default=4)
    ap.add_argument("--budget-gib", type=float, default=24.0)
    # runs/bench unless --out benchmarks/results refreshes the committed figures
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "runs", "bench"),
                    help="output folder (default runs/bench; the committed figures are in "
                         "benchmarks/results)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    tmp = os.path.join(args.out, "long_context_runs.tmp")
    os.makedirs(tmp, exist_ok=True)
    json_path = os.path.join(args.out, "long_context.json")
    result: dict[str, Any] = {}
    if os.path.isfile(json_path):  # parts run separately accumulate
        with open(json_path) as f:
            result = json.load(f)
    result["machine"] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "note": "CPU, gloo; peak = resident-set high-water mark per rank",
    }
    for part in args.only:
        if part != "sizes":
            result[f"{part}_model"] = {"hidden": args.hidden, "layers": args.layers, "head_dim": 16}
        t0 = time.time()
        result[part] = {"lengths": lengths, "per_rank": per_rank, "sizes": sizes}[part](args, tmp)
        result[f"{part}_wall_s"] = time.time() - t0
        with open(json_path, "w") as f:  # after each part: a long run keeps what it measured
            json.dump(result, f, indent=2)
    if "sizes" in result:
        s = result["sizes"]
        result["sizes"]["width_fit"] = width_fit(s)
        # the projection is from one process; check it against a real CP run at the target
        real = [
            r
            for r in result.get("lengths", [])
            if r["status"] == "ok"
            and r["seq_length"] == s["target_seq"]
            and r["cp"] == s["target_cp"]
        ]
        model = result.get("lengths_model", {})
        row = [r for r in s["rows"] if r["hidden"] == model.get("hidden") and "fixed_bytes" in r]
        if real and row and model.get("layers") == s["rows"][0]["layers"]:
            projected = row[0]["fixed_bytes"] + row[0]["bytes_per_token"] * (
                s["target_seq"] // s["target_cp"]
            )
            factor = max(real[0]["peak_mem_bytes_per_rank"]) / projected
            s["check_against_cp_run"] = {
                "hidden": model["hidden"],
                "measured_gib": max(real[0]["peak_mem_bytes_per_rank"]) / GIB,
                "projected_gib": projected / GIB,
                "factor": factor,
            }
            s["width_fit_with_cp_factor"] = width_fit(s, cp_factor=max(factor, 1.0))
        for key in ("width_fit", "check_against_cp_run", "width_fit_with_cp_factor"):
            print(f"[sizes] {key}: {result['sizes'].get(key)}", flush=True)
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    plot(result, os.path.join(args.out, "long_context.png"))
    print(f"wrote {json_path} and long_context.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The GPU lease's results in one JSON and one markdown page (benchmarks/gpu_lease.sh).

Reads what the stages left in ``--dir`` (each file optional: a failed stage shows as
missing figures, never as an error here): ``stages.tsv``, ``peer.json``,
``kernels.json``, ``layer.json``, ``check.json`` (bench_gpu.py),
``megatron_<attention>_<T>.json`` and ``train_1m.jsonl``; writes ``summary.json``
(every figure and every target with its verdict) and ``summary.md`` (tables to paste
into docs/benchmarks.md).

    python benchmarks/gpu_summary.py --dir runs/gpu_lease
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

MEGATRON_TARGET = 1.5  # hla2's tokens/s over softmax's at 32k, at least (issue 50)
MEGATRON = re.compile(r"megatron_(\w+?)_(\d+)k\.json$")


def load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def stages(d: Path) -> list[dict[str, Any]]:
    rows = []
    try:
        lines = (d / "stages.tsv").read_text().splitlines()
    except OSError:
        return rows
    for line in lines:
        name, rc, secs, limit = [*line.split("\t"), "", "", "", ""][:4]
        rows.append(dict(stage=name, exit=rc, seconds=int(secs or 0), limit=int(limit or 0)))
    return rows


def train_1m(d: Path) -> dict[str, Any] | None:
    """The last iteration record of hla-sp train's JSONL (after its warm-up step)."""
    try:
        recs = [json.loads(x) for x in (d / "train_1m.jsonl").read_text().splitlines() if x]
    except (OSError, ValueError):
        return None
    its = [r for r in recs if "iteration" in r and "step_time_s" in r]
    if not its:
        return None
    r = its[-1]
    keys = ("iteration", "seq_length", "step_time_s", "peak_mem_bytes", "tokens_per_s",
            "tflops_per_rank", "mfu", "loss", "attention")
    return {k: r.get(k) for k in keys} | dict(first_step_time_s=its[0]["step_time_s"])


def megatron(d: Path) -> dict[str, Any]:
    """Runs by (attention, k tokens), and hla2's tokens/s over softmax's per length."""
    runs: dict[str, Any] = {}
    for f in sorted(d.glob("megatron_*.json")):
        m = MEGATRON.search(f.name)
        res = load(f)
        if m and res is not None:
            runs[f"{m.group(1)} {m.group(2)}k"] = res
    ratios = []
    for k in sorted({key.split()[1] for key in runs}, key=lambda s: int(s[:-1])):
        a, b = runs.get(f"hla2 {k}", {}), runs.get(f"softmax {k}", {})
        x, y = a.get("tokens_per_s"), b.get("tokens_per_s")
        r = x / y if x and y else None
        bound = MEGATRON_TARGET if k == "32k" else None
        ratios.append(dict(seq=k, ratio=r, bound=bound,
                           ok=None if r is None or bound is None else r >= bound))
    return dict(runs=runs, hla2_over_softmax=ratios)


def targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target of the run, one list: what, where, value, bound, verdict."""
    out = []
    for t in (summary.get("peer") or {}).get("targets", []):
        out.append(dict(target=t["target"], where=t["shape"], value=t["value"],
                        bound=f"<= {t['bound']}", ok=t["ok"]))
    k = summary.get("kernels") or {}
    lt = k.get("launch_target")
    if lt:
        out.append(dict(target="GPU launches of one linear_attention fwd+bwd", where=k.get(
            "shape", ""), value=lt["launches"], bound=f"<= {lt['bound']}", ok=lt["ok"]))
    for name, s in (k.get("sync") or {}).items():
        out.append(dict(target=f"no host sync in {name} (sync debug mode 'error')", where="",
                        value=s.get("error", "none" if s.get("ok") else None), bound="none",
                        ok=s.get("ok")))
    checks = [c for c in (summary.get("check") or {}).get("check", []) if c.get("ok") is not None]
    if checks:
        bad = [f"{c['op']} {c.get('dtype', '')}".strip() for c in checks if not c["ok"]]
        out.append(dict(target="kernels against the fp64 torch path (bench_gpu.py)", where="",
                        value=f"{len(checks) - len(bad)} of {len(checks)} within bounds"
                        + (f"; failed: {', '.join(bad)}" if bad else ""), bound="all",
                        ok=not bad))
    for r in (summary.get("megatron") or {}).get("hla2_over_softmax", []):
        if r["bound"] is not None:
            out.append(dict(target="Megatron loop: hla2 tokens/s over softmax (flash)",
                            where=r["seq"], value=r["ratio"], bound=f">= {r['bound']}",
                            ok=r["ok"]))
    return out


def estimates_us(shape: str) -> dict[str, float]:
    """The roofline model's microseconds per role (benchmarks/roofline.py, H200) at a
    shape label "B1 T32768 H16 K128"; fwd_h sums the forward and the recompute, as the
    profile does. Empty when the label does not parse (the dry run's tiny shapes too)."""
    import roofline

    m = re.fullmatch(r"B(\d+) T(\d+) H(\d+) K(\d+)", shape or "")
    if not m:
        return {}
    B, T, H, K = (int(x) for x in m.groups())
    if T % roofline.BT or K % 64:
        return {}
    out: dict[str, float] = {}
    for bwd in (False, True):
        for k in roofline.primitive(B, T, H, K, K, "H200", bwd):
            r = k.name.split(" ")[0]
            out[r] = out.get(r, 0.0) + k.seconds(*roofline.GPUS["H200"])[1] * 1e6
    return out


def fmt(x: Any, nd: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:,.{nd}f}"
    return str(x)


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT met")


def markdown(s: dict[str, Any]) -> str:
    md = [f"GPU lease: {s.get('device') or 'unknown device'}"
          + (" (DRY RUN: CPU plumbing check, no measurement)" if s.get("dry_run") else ""), ""]
    md += ["| stage | exit | s | limit (s) |", "|---|---|---|---|"]
    md += [f"| {r['stage']} | {r['exit']} | {r['seconds']} | {r['limit']} |" for r in s["stages"]]
    peer = s.get("peer") or {}
    rows = peer.get("timings", [])
    if rows:
        methods = list(dict.fromkeys(r["method"] for r in rows))
        shapes = list(dict.fromkeys(r["shape"] for r in rows))
        ms = {(r["shape"], r["method"]): r["ms"] for r in rows}
        md += ["", "Forward + backward, ms (do_bench median):", "",
               "| shape | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
        md += [f"| {sh} | " + " | ".join(fmt(ms.get((sh, m))) for m in methods) + " |"
               for sh in shapes]
    if s["targets"]:
        md += ["", "| target | where | value | bound | verdict |", "|---|---|---|---|---|"]
        md += [f"| {t['target']} | {t['where']} | {fmt(t['value'])} | {t['bound']} | "
               f"{verdict(t['ok'])} |" for t in s["targets"]]
    agree = peer.get("agreement") or {}
    if agree:
        md += ["", "Our output against fla's on the same inputs (relative error): "
               + "; ".join(f"{k}: {fmt(v.get('error'), 5) if 'error' in v else v.get('skipped')}"
                           for k, v in agree.items())]
    table = (s.get("kernels") or {}).get("table") or []
    if table:
        est = estimates_us(s["kernels"].get("shape"))
        md += ["", f"Per kernel, one fwd+bwd with per-token decay ({s['kernels'].get('shape')}):",
               "", "| role | ours ms (launches) | fla ms (launches) | ours / fla | "
               "estimate ms (roofline model) | kernels |", "|---|---|---|---|---|---|"]
        for r in table:
            names = ", ".join(sorted(set((r["ours_names"] or []) + (r["fla_names"] or []))))
            e = est.get(r["role"])
            md.append(f"| {r['role']} | {fmt(r['ours_ms'])} ({fmt(r['ours_calls'])}) | "
                      f"{fmt(r['fla_ms'])} ({fmt(r['fla_calls'])}) | {fmt(r['ratio'], 2)} | "
                      f"{fmt(e / 1e3 if e else None)} | {names[:160]} |")
    tuned = (s.get("kernels") or {}).get("tuned") or []
    if tuned:
        md += ["", "Tiles the tuner chose (BK x BV, warps): " + "; ".join(
            f"{r['role']} {r['dtype']} K {r['K']} V {r['V']} ({r['key']}): {r['BK']} x "
            f"{r['BV']}, {r['num_warps']}" for r in tuned)]
    mg = (s.get("megatron") or {}).get("runs") or {}
    if mg:
        md += ["", "Megatron-LM loop (8 layers, width 1024, 8 heads over 4 kv groups, bf16):",
               "", "| run | tokens/s | ms/iter | model TFLOP/s (linear-aware) | MFU | "
               "Megatron's TFLOP/s |", "|---|---|---|---|---|---|"]
        md += [f"| {k} | {fmt(r.get('tokens_per_s'), 0)} | {fmt(r.get('ms_per_iter'), 1)} | "
               f"{fmt(r.get('model_tflops_per_gpu'), 1)} | {fmt(r.get('mfu'), 4)} | "
               f"{fmt(r.get('megatron_tflops_per_gpu'), 1)} |" for k, r in mg.items()]
    t = s.get("train_1m")
    if t:
        md += ["", f"hla-sp train, one {t['seq_length']:,}-token sequence on one GPU: step "
               f"{fmt(t['step_time_s'], 2)} s (first step {fmt(t['first_step_time_s'], 2)} s), "
               f"peak memory {t['peak_mem_bytes'] / 2**30:.1f} GiB, "
               f"{fmt(t['tokens_per_s'], 0)} tokens/s."]
    lay = (s.get("layer") or {}).get("rows") or []
    if lay:
        md += ["", "| layer | T | ms | tokens/s | TFLOP/s |", "|---|---|---|---|---|"]
        md += [f"| {r['layer']} | {r['T']} | {fmt(r['ms'])} | {fmt(r['tokens_per_s'], 0)} | "
               f"{fmt(r['tflops'], 1)} |" for r in lay]
    return "\n".join(md) + "\n"


def summarize(d: Path, budget_s: int | None = None) -> dict[str, Any]:
    peer, kernels, layer, check = (load(d / f"{n}.json")
                                   for n in ("peer", "kernels", "layer", "check"))
    if kernels and kernels.get("profiles"):
        kernels["shape"] = next(iter(kernels["profiles"]))
        kernels.pop("profiles")  # the raw profiles stay in kernels.json
    head = next((x for x in (peer, kernels, layer) if x), {}) or {}
    s: dict[str, Any] = dict(device=head.get("device"), torch=head.get("torch"),
                             triton=head.get("triton"), fla=head.get("fla"),
                             dry_run=head.get("dry_run"), budget_s=budget_s,
                             stages=stages(d), peer=peer, kernels=kernels, layer=layer,
                             check=check,
                             megatron=megatron(d), train_1m=train_1m(d))
    s["targets"] = targets(s)
    if s["dry_run"]:  # the plumbing ran; nothing was measured, so nothing is met or missed
        for t in s["targets"]:
            t["ok"] = None
    return s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--budget-s", type=int, default=None)
    a = p.parse_args()
    s = summarize(a.dir, a.budget_s)
    (a.dir / "summary.json").write_text(json.dumps(s, indent=1, default=str))
    (a.dir / "summary.md").write_text(markdown(s))
    print(f"wrote {a.dir / 'summary.json'} and summary.md: {len(s['targets'])} targets, "
          f"{sum(t['ok'] is True for t in s['targets'])} met")
    return 0


if __name__ == "__main__":
    sys.exit(main())

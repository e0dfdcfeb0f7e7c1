"""Scaling experiments with Ray Train: ``hla-sp sweep CONFIG`` (JSON or TOML).

For each world size P, Ray Train's ``TorchTrainer`` starts P workers with
``ScalingConfig(num_workers=P, use_gpu=...)``; Ray creates the process group, and the
workers run this project's trainer (:func:`hla_sp.launch.train.run`) once per sequence
length T, with context parallelism over all P ranks unless the config says otherwise
(peak memory is reset between runs). The sweep collects tokens/s, step time, per-rank peak memory
and loss, and writes ``results.json``, ``results.csv``, ``throughput_vs_p.png`` and
``memory_vs_seq.png`` to the output directory.

Config keys (TOML shown; JSON has the same shape)::

    world_sizes = [1, 2]            # P values
    seq_lengths = [1024, 4096]      # T values
    train_iters = 3                 # steps per point; the first is warm-up, not timed
    use_gpu = false
    output_dir = "runs/sweep"
    [ray]                            # ray.init arguments for a local cluster
    num_cpus = 4                     # or: address = "auto" to join a running cluster
    [trainer]                        # any trainer flag, by field name
    num_layers = 2
    hidden_size = 64

The Ray dashboard is never started by this tool (``include_dashboard=False``); a local
cluster binds to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from typing import Any

from hla_sp.launch.config import ConfigError, TrainConfig, parse_args, validate

_KNOWN = {"world_sizes", "seq_lengths", "train_iters", "use_gpu", "output_dir", "ray", "trainer"}


def load_config(path: str) -> dict[str, Any]:
    """Read a sweep config from JSON (``.json``) or TOML (anything else)."""
    if path.endswith(".json"):
        with open(path) as f:
            cfg = json.load(f)
    else:
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib  # type: ignore[no-redef]
        with open(path, "rb") as f:
            cfg = tomllib.load(f)
    unknown = set(cfg) - _KNOWN
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(_KNOWN)}")
    for key in ("world_sizes", "seq_lengths"):
        if not cfg.get(key) or not all(isinstance(v, int) and v > 0 for v in cfg[key]):
            raise ConfigError(f"{path}: {key} must be a non-empty list of positive integers")
    return cfg


def flags_from_mapping(values: dict[str, Any]) -> list[str]:
    """``{"num_layers": 2, "recompute_activations": True}`` -> ``--num-layers 2 ...``."""
    argv: list[str] = []
    for key, v in values.items():
        flag = "--" + key.replace("_", "-")
        if v is True:
            argv.append(flag)
        elif v is False or v is None:
            continue
        elif isinstance(v, list):
            argv += [flag, *map(str, v)]
        else:
            argv += [flag, str(v)]
    return argv


def point_config(sweep: dict[str, Any], world_size: int, seq_length: int) -> TrainConfig:
    """The trainer config of one grid point (CP over all P ranks unless set), parsed by the
    trainer's own parser so that every default, HLA flags included, is the CLI's."""
    base = {k.replace("-", "_"): v for k, v in sweep.get("trainer", {}).items()}
    base.setdefault("context_parallel_size", world_size)
    base["seq_length"] = seq_length
    base["train_iters"] = int(sweep.get("train_iters", 3))
    return parse_args(flags_from_mapping(base))


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-point figures; the first step (allocation, warm-up) is not timed when others exist."""
    timed = records[1:] if len(records) > 1 else records
    step = sum(r["step_time_s"] for r in timed) / len(timed)
    last = records[-1]
    return {
        "tokens_per_s": last["tokens"] / step,
        "step_time_s": step,
        "peak_mem_bytes_per_rank": last["peak_mem_bytes_per_rank"],
        "peak_mem_bytes_max": max(last["peak_mem_bytes_per_rank"]),
        "loss_first": records[0]["loss"],
        "loss_last": last["loss"],
        "iters": len(records),
        "tokens_per_step": last["tokens"],
    }


def _train_loop_per_worker(config: dict[str, Any]) -> dict[str, Any]:
    """Runs in each Ray worker: the trainer over Ray's process group, once per sequence
    length (the workers start once per P; each run resets the peak-memory mark)."""
    import ray.train
    from hla_sp.launch.train import run

    summaries = {}
    for point in config["points"]:
        records = run(TrainConfig.from_dict(point), exit_on_error=False)
        summaries[str(point["seq_length"])] = summarize(records)
    ray.train.report({"points": summaries})  # a barrier over the workers
    return summaries


def _run_world_size(
    cfgs: list[TrainConfig], world_size: int, use_gpu: bool, storage: str
) -> dict[str, dict[str, Any]]:
    """One TorchTrainer with P workers over all sequence lengths; seq_length -> summary."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        _train_loop_per_worker,
        train_loop_config={"points": [c.to_dict() for c in cfgs]},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=world_size, use_gpu=use_gpu, resources_per_worker={"CPU": 1}
        ),
        run_config=RunConfig(name=f"p{world_size}_{int(time.time())}", storage_path=storage),
    )
    result = trainer.fit()
    summaries = getattr(result, "return_value", None) or (result.metrics or {}).get("points")
    if not summaries:
        raise RuntimeError(f"P={world_size}: the workers returned no metrics")
    return dict(summaries)


def write_outputs(rows: list[dict[str, Any]], out_dir: str) -> list[str]:
    """results.json, results.csv and the two plots; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, n) for n in ("results.json", "results.csv")]
    with open(paths[0], "w") as f:
        json.dump(rows, f, indent=2)
    cols = [
        "world_size", "cp", "seq_length", "status", "tokens_per_s", "step_time_s",
        "peak_mem_bytes_max", "peak_mem_bytes_per_rank", "loss_first", "loss_last", "error",
    ]  # fmt: skip
    with open(paths[1], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(
                {**r, "peak_mem_bytes_per_rank": json.dumps(r.get("peak_mem_bytes_per_rank"))}
            )
    ok = [r for r in rows if r["status"] == "ok"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for t in sorted({r["seq_length"] for r in ok}):
        pts = sorted((r["world_size"], r["tokens_per_s"]) for r in ok if r["seq_length"] == t)
        ax.plot([p for p, _ in pts], [v for _, v in pts], marker="o", label=f"T={t:,}")
    ax.set(xlabel="ranks P", ylabel="tokens / s", title="Throughput against P")
    ax.legend()
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "throughput_vs_p.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for p in sorted({r["world_size"] for r in ok}):
        pts = sorted((r["seq_length"], r["peak_mem_bytes_max"]) for r in ok if r["world_size"] == p)
        ax.plot([t for t, _ in pts], [m / 2**30 for _, m in pts], marker="o", label=f"P={p}")
    ax.set(xlabel="sequence length T", ylabel="peak memory per rank (GiB)", title="Memory")
    ax.set_xscale("log", base=2)
    ax.legend()
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "memory_vs_seq.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def sweep(config_path: str, output_dir: str | None = None) -> list[dict[str, Any]]:
    """Run the grid; every point is validated before Ray starts."""
    sweep_cfg = load_config(config_path)
    out = os.path.abspath(output_dir or sweep_cfg.get("output_dir", "runs/sweep"))
    use_gpu = bool(sweep_cfg.get("use_gpu", False))
    grid = [(p, t) for p in sweep_cfg["world_sizes"] for t in sweep_cfg["seq_lengths"]]
    points = [(p, t, point_config(sweep_cfg, p, t)) for p, t in grid]
    for p, _, cfg in points:
        validate(cfg, p)  # a bad grid fails here, before any worker starts
    import ray

    ray_args = dict(sweep_cfg.get("ray", {}))
    if "address" not in ray_args:
        ray_args.setdefault("num_cpus", max(sweep_cfg["world_sizes"]) + 1)
        ray_args.setdefault("_node_ip_address", "127.0.0.1")  # a local cluster stays local
    ray.init(include_dashboard=False, log_to_driver=True, **ray_args)
    rows: list[dict[str, Any]] = []
    try:
        for p in sweep_cfg["world_sizes"]:
            # ascending T: a point that runs out of memory ends only the longer ones
            mine = sorted((c for q, _, c in points if q == p), key=lambda c: c.seq_length)
            print(f"[sweep] P={p}: T in {[c.seq_length for c in mine]} ...", flush=True)
            try:
                got = _run_world_size(mine, p, use_gpu, os.path.join(out, "ray_results"))
                error = None
            except Exception as e:  # a failed P (e.g. out of memory) does not end the grid
                got, error = {}, f"{type(e).__name__}: {e}"[:2000]
                print(f"[sweep] P={p} failed: {error[:300]}", flush=True)
            for c in mine:
                t = c.seq_length
                row: dict[str, Any] = {"world_size": p, "cp": c.context_parallel_size}
                row["seq_length"] = t
                if str(t) in got:
                    row.update(got[str(t)], status="ok")
                    print(
                        f"[sweep] P={p} T={t:,}: {row['tokens_per_s']:,.0f} tok/s, step "
                        f"{row['step_time_s']:.2f} s, peak "
                        f"{row['peak_mem_bytes_max'] / 2**30:.2f} GiB/rank, loss "
                        f"{row['loss_first']:.3f} -> {row['loss_last']:.3f}",
                        flush=True,
                    )
                else:
                    row.update(status="failed", error=error or "no result")
                rows.append(row)
    finally:
        ray.shutdown()
    for path in write_outputs(rows, out):
        print(f"[sweep] wrote {path}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hla-sp sweep", description=__doc__.split("\n")[0])
    ap.add_argument("config", help="Sweep config (.json or .toml).")
    ap.add_argument("--output-dir", default=None, help="Overrides output_dir in the config.")
    a = ap.parse_args(argv)
    try:
        rows = sweep(a.config, a.output_dir)
    except ConfigError as e:
        print(f"hla-sp sweep: error: {e}", file=sys.stderr)
        return 2
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

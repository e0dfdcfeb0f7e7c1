"""Scaling experiments with Ray Train: ``hla-sp sweep CONFIG`` (JSON or TOML).

For each world size P, Ray Train's ``TorchTrainer`` starts P workers with
``ScalingConfig(num_workers=P, use_gpu=...)``; Ray creates the process group, and the
workers run this project's trainer (:func:`hla_sp.launch.train.main.run`) once per sequence
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
cluster binds to 127.0.0.1. Before Ray starts, the file's keys and values are checked
(errors name the file and the key), every grid point is validated as the trainer would,
and the cluster must have a CPU (GPU with ``use_gpu``) per worker of the largest world
size: Ray would otherwise wait for resources that never come. Ray's own messages are
filtered from the output and each worker line is printed once; ``ray.shutdown()`` runs
on every exit (errors, Ctrl-C, SIGTERM), so no actor outlives the driver.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import signal
import sys
import time
from collections import deque
from collections.abc import Iterator
from types import ModuleType
from typing import Any, TextIO

from hla_sp.launch.checks import validate
from hla_sp.launch.config.train_config import ConfigError, TrainConfig
from hla_sp.launch.extras import pyplot, require

# Re-exported: the sweep's file checks are imported from here (tests, docs).
from hla_sp.launch.sweep.sweep_config import (
    check_resources,
    flags_from_mapping,
    load_config,
    point_config,
)
from hla_sp.launch.train.main import run

__all__ = ["flags_from_mapping", "load_config", "main", "memory_figure", "point_config",
           "summarize", "sweep", "throughput_figure", "write_outputs"]


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


def _ray() -> ModuleType:
    """Ray with Ray Train and its torch trainer, imported on first use: the sweep's one
    import of Ray (the ray extra)."""
    import ray
    import ray.train
    import ray.train.torch

    return ray


def _train_loop_per_worker(config: dict[str, Any]) -> dict[str, Any]:
    """Runs in each Ray worker: the trainer over Ray's process group, once per sequence
    length (the workers start once per P; each run resets the peak-memory mark)."""
    ray = _ray()
    summaries = {}
    for point in config["points"]:
        cfg = TrainConfig.from_dict(point)
        records = run(cfg, exit_on_error=False)
        summaries[str(cfg.model.seq_length)] = summarize(records)
    ray.train.report({"points": summaries})  # a barrier over the workers
    return summaries


def _run_world_size(
    cfgs: list[TrainConfig], world_size: int, use_gpu: bool, storage: str
) -> dict[str, dict[str, Any]]:
    """One TorchTrainer with P workers over all sequence lengths; seq_length -> summary."""
    train = _ray().train
    trainer = train.torch.TorchTrainer(
        _train_loop_per_worker,
        train_loop_config={"points": [c.to_dict() for c in cfgs]},
        torch_config=train.torch.TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=train.ScalingConfig(
            num_workers=world_size, use_gpu=use_gpu, resources_per_worker={"CPU": 1}
        ),
        run_config=train.RunConfig(name=f"p{world_size}_{int(time.time())}", storage_path=storage),
    )
    result = trainer.fit()
    summaries = getattr(result, "return_value", None) or (result.metrics or {}).get("points")
    if not summaries:
        raise RuntimeError(f"P={world_size}: the workers returned no metrics")
    return dict(summaries)


def throughput_figure(ok: list[dict[str, Any]]) -> Any:
    """tokens/s against P, one line per T; P ticks are the world sizes run."""
    fig, ax = pyplot().subplots(figsize=(5, 3.5))
    for t in sorted({r["seq_length"] for r in ok}):
        pts = sorted((r["world_size"], r["tokens_per_s"]) for r in ok if r["seq_length"] == t)
        ax.plot([p for p, _ in pts], [v for _, v in pts], marker="o", label=f"T={t:,}")
    ax.set(xlabel="ranks P", ylabel="tokens / s", title="Throughput against P")
    ax.set_xticks(sorted({r["world_size"] for r in ok}))  # P is a whole number of ranks
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    return fig


def memory_figure(ok: list[dict[str, Any]]) -> Any:
    """Peak memory per rank against T, one line per P, on an axis from zero."""
    fig, ax = pyplot().subplots(figsize=(5, 3.5))
    for p in sorted({r["world_size"] for r in ok}):
        pts = sorted((r["seq_length"], r["peak_mem_bytes_max"]) for r in ok if r["world_size"] == p)
        ax.plot([t for t, _ in pts], [m / 2**30 for _, m in pts], marker="o", label=f"P={p}")
    ax.set(xlabel="sequence length T", ylabel="peak memory per rank (GiB)", title="Memory")
    ax.set_xscale("log", base=2)
    # from zero: a few MB of difference must not look like a steep line
    ax.set_ylim(bottom=0, top=max([r["peak_mem_bytes_max"] for r in ok] + [1]) / 2**30 * 1.15)
    ax.legend()
    fig.tight_layout()
    return fig


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
    plt = pyplot()
    for name, fig in (("throughput_vs_p.png", throughput_figure(ok)),
                      ("memory_vs_seq.png", memory_figure(ok))):
        paths.append(os.path.join(out_dir, name))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


# Lines of Ray's own machinery that say nothing about the sweep (a quarter of the output
# otherwise); worker lines are kept, and errors of any actor.
_NOISE = re.compile(
    r"PlacementGroupCleaner|Failed to query Ray Train Controller|core_worker\.cc|"
    r"Requesting resources|Attempting to start training worker group|"
    r"Started training worker group|world_rank=\d+, local_rank=|Setting up process group|"
    r"Reporting training result|Megatron-FSDP|learning rate decay style|"
    r"Transformer Engine and Apex|warnings\.warn\(|UserWarning"
)
_PREFIX = re.compile(r"^(?:\x1b\[[0-9;]*m)*\((\w+) pid=\d+(?:, ip=[^)]*)?\)(?:\x1b\[[0-9;]*m)* ?")


class _SweepOutput:
    """A text stream in front of stdout/stderr while Ray runs: drops Ray's noise, prints
    each worker line once (Ray Train echoes worker output twice), prefixes the grid point."""

    def __init__(self, stream: TextIO, seen: deque[str]):
        self.stream, self.seen, self._buf = stream, seen, ""
        self.point = ""

    def write(self, text: str) -> int:
        self._buf += text
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            self._line(line)
        return len(text)

    def _line(self, line: str) -> None:
        m = _PREFIX.match(line)
        if m is None:  # the driver's own lines
            self.stream.write(line + "\n")
            return
        actor, body = m.group(1), line[m.end():]
        if _NOISE.search(body) or (actor != "RayTrainWorker" and "rror" not in body):
            return
        if not body.strip() or body in self.seen:
            return
        self.seen.append(body)
        self.stream.write(f"[sweep {self.point}] {body}\n" if self.point else body + "\n")

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding ...
        return getattr(self.stream, name)


@contextlib.contextmanager
def _filtered_output() -> Iterator[list[_SweepOutput]]:
    """Route sys.stdout/sys.stderr through :class:`_SweepOutput` (Ray prints worker lines
    through them in the driver); restored on exit."""
    seen: deque[str] = deque(maxlen=256)
    out, err = _SweepOutput(sys.stdout, seen), _SweepOutput(sys.stderr, seen)
    sys.stdout, sys.stderr = out, err  # type: ignore[assignment]
    try:
        yield [out, err]
    finally:
        sys.stdout, sys.stderr = out.stream, err.stream
        for s in (out, err):
            if s._buf:
                s.stream.write(s._buf + "\n")
            s.stream.flush()


def _shutdown_on_signal() -> None:
    """SIGTERM (a scheduler's stop) ends the driver through ``finally`` (ray.shutdown)."""
    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        signal.signal(signal.SIGTERM, handler)


def sweep(config_path: str, output_dir: str | None = None) -> list[dict[str, Any]]:
    """Run the grid; the file, every point and the resources are checked before Ray
    starts any worker."""
    sweep_cfg = load_config(config_path)
    out = os.path.abspath(output_dir or sweep_cfg.get("output_dir", "runs/sweep"))
    use_gpu = bool(sweep_cfg.get("use_gpu", False))
    grid = [(p, t) for p in sweep_cfg["world_sizes"] for t in sweep_cfg["seq_lengths"]]
    points = []
    for p, t in grid:
        try:
            cfg = point_config(sweep_cfg, p, t)
            validate(cfg, p)  # a bad grid fails here, before any worker starts
        except ConfigError as e:
            raise ConfigError(f"{config_path}: world size {p}, seq length {t}: {e}") from None
        points.append((p, t, cfg))
    need = max(sweep_cfg["world_sizes"])
    ray_args = dict(sweep_cfg.get("ray", {}))
    if "address" not in ray_args:
        ray_args.setdefault("num_cpus", need + 1)
        ray_args.setdefault("_node_ip_address", "127.0.0.1")  # a local cluster stays local
        have = {"CPU": ray_args["num_cpus"], "GPU": ray_args.get("num_gpus", 0)}
        if use_gpu and "num_gpus" not in ray_args:
            have["GPU"] = _local_gpus()
        check_resources(config_path, have, need, use_gpu, "local cluster")
    ray = _ray()

    _shutdown_on_signal()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    rows: list[dict[str, Any]] = []
    with _filtered_output() as streams:
        try:
            ray.init(include_dashboard=False, log_to_driver=True, **ray_args)
            if "address" in ray_args:  # a running cluster: ask it
                check_resources(config_path, ray.cluster_resources(), need, use_gpu,
                                f"cluster at {ray_args['address']}")
            _run_grid(sweep_cfg, points, use_gpu, out, rows, streams)
        finally:
            ray.shutdown()  # ends every actor of this driver, on errors and signals too
    for path in write_outputs(rows, out):
        print(f"[sweep] wrote {path}", flush=True)
    return rows


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _run_grid(
    sweep_cfg: dict[str, Any],
    points: list[tuple[int, int, TrainConfig]],
    use_gpu: bool,
    out: str,
    rows: list[dict[str, Any]],
    streams: list[_SweepOutput],
) -> None:
    """One TorchTrainer per world size; appends a row per grid point to ``rows``."""
    from hla_sp.launch.progress import Progress

    # grid points done of all, on the real stderr (Ray's workers write through streams)
    bar = Progress("sweep", len(points), "grid points", stream=sys.__stderr__)
    for p in sweep_cfg["world_sizes"]:
        # ascending T: a point that runs out of memory ends only the longer ones
        mine = sorted((c for q, _, c in points if q == p), key=lambda c: c.model.seq_length)
        for st in streams:
            st.point = f"P={p}"
        bar.say(f"[sweep] P={p}: T in {[c.model.seq_length for c in mine]} ...")
        try:
            got = _run_world_size(mine, p, use_gpu, os.path.join(out, "ray_results"))
            error = None
        except Exception as e:  # a failed P (e.g. out of memory) does not end the grid
            got, error = {}, f"{type(e).__name__}: {e}"[:2000]
            bar.say(f"[sweep] P={p} failed: {error[:300]}")
        for c in mine:
            t = c.model.seq_length
            row: dict[str, Any] = {"world_size": p, "cp": c.parallelism.context_parallel_size}
            row["seq_length"] = t
            if str(t) in got:
                row.update(got[str(t)], status="ok")
                bar.say(
                    f"[sweep] P={p} T={t:,}: {row['tokens_per_s']:,.0f} tok/s, step "
                    f"{row['step_time_s']:.2f} s, peak "
                    f"{row['peak_mem_bytes_max'] / 2**30:.2f} GiB/rank, loss "
                    f"{row['loss_first']:.3f} -> {row['loss_last']:.3f}"
                )
            else:
                row.update(status="failed", error=error or "no result")
            rows.append(row)
        bar.advance(len(mine), note=f"P={p} done")
    bar.close()


def main(argv: list[str] | None = None) -> int:
    from hla_sp.launch.config.flags import plain

    ap = argparse.ArgumentParser(prog="hla-sp sweep", description=plain(__doc__.split("\n")[0]))
    ap.add_argument("config", help="Sweep config (.json or .toml).")
    ap.add_argument("--output-dir", default=None, help="Overrides output_dir in the config.")
    a = ap.parse_args(argv)

    try:
        require("ray", "hla-sp sweep")
        require("megatron", "hla-sp sweep")  # the workers run the trainer
        rows = sweep(a.config, a.output_dir)
    except ConfigError as e:
        print(f"hla-sp sweep: error: {e}", file=sys.stderr)
        return 2
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

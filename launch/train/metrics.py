"""Progress lines (rank 0), JSONL records, and peak memory per rank."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any, TextIO

import torch
from hla_sp.launch.extras import pyplot
from hla_sp.launch.progress import count, duration


def peak_memory_bytes() -> int:
    """Peak memory of this process since :func:`reset_peak_memory`: CUDA's allocator peak
    on GPU, the resident-set high-water mark (VmHWM) on CPU.

    On CPU the figure includes the interpreter, torch and megatron (about half a GiB);
    compare runs against each other, not against tensor sizes alone.
    """
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    # elsewhere: the lifetime peak (ru_maxrss is KiB on Linux, bytes on macOS)
    scale = 1 if sys.platform == "darwin" else 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale


def reset_peak_memory() -> None:
    """Start a new peak (so that one process can measure several runs in turn)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return
    try:  # Linux: "5" resets the resident-set high-water mark
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def progress_line(rec: dict[str, Any], train_iters: int) -> str:
    """One human line per logged iteration."""
    extra = ""
    if "val_loss" in rec:
        extra += f" | val loss {rec['val_loss']:.4f}"
    if "val_recall_acc" in rec:
        extra += f" | recall acc {rec['val_recall_acc']:.3f}"
    if "loss_scale" in rec:
        extra += f" | loss scale {rec['loss_scale']:.3g}" + (" (skipped)" if rec["skipped"] else "")
    elif rec.get("skipped"):  # --no-check-for-nan-in-loss-and-grad: not stepped
        extra += " | non-finite: step skipped"
    if "tflops_per_rank" in rec:
        extra += (f" | {rec['tflops_per_rank']:.3g} TFLOP/s per rank "
                  f"({rec['tflops_total']:.3g} total)")
        if "mfu" in rec:
            extra += f" | MFU {100 * rec['mfu']:.1f}%"
    if "consumed_tokens" in rec:
        extra += f" | {count(rec['consumed_tokens'])} tokens"
    if "elapsed_s" in rec:
        extra += f" | elapsed {duration(rec['elapsed_s'])}, ETA {duration(rec['eta_s'])}"
    return (
        f"iter {rec['iteration']:>5}/{train_iters} | loss {rec['loss']:.4f} | "
        f"lr {rec['lr']:.2e} | grad-norm {rec['grad_norm']:.3f} | "
        f"{rec['tokens_per_s']:,.0f} tok/s"
        + (f" ({rec['tokens_per_s_per_rank']:,.0f} per rank)"
           if "tokens_per_s_per_rank" in rec else "")
        + f" | step {rec['step_time_s']:.2f} s | "
        f"peak mem {gib(rec['peak_mem_bytes'])} "
        f"(max of {len(rec['peak_mem_bytes_per_rank'])} ranks){extra}"
    )


def start_marker(
    iteration: int, config: dict[str, Any], resumed_from: int | None
) -> dict[str, Any]:
    """The JSONL line that opens a run: ``{"event": "start", ...}``. Re-runs and resumes
    append to the same file; readers split it at these lines (:func:`read_records`)."""
    return {
        "event": "start",
        "iteration": iteration,
        "resumed_from": resumed_from,
        "time": time.time(),
        "config": config,
    }


def read_records(path: str) -> list[dict[str, Any]]:
    """The iteration records of a JSONL log, without the start markers; when runs
    overlap (a re-run, a resume from an earlier checkpoint) an iteration's last record wins."""
    by_iter: dict[int, dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                if "event" not in rec:
                    by_iter[rec["iteration"]] = rec
    return [by_iter[i] for i in sorted(by_iter)]


def plot_run(jsonl: str) -> str:
    """Loss (training and validation) and tokens/s against iteration, as a PNG next to
    ``jsonl`` (same name, .png); returns the line to print. Without matplotlib the line
    says which extra installs it."""
    png = os.path.splitext(jsonl)[0] + ".png"
    try:
        plt = pyplot()
    except ImportError:
        return 'plot: skipped, matplotlib is not installed (pip install "hla-sp[plot]")'

    recs = read_records(jsonl)
    its = [r["iteration"] for r in recs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.plot(its, [r["loss"] for r in recs], label="training")
    val = [(r["iteration"], r["val_loss"]) for r in recs if "val_loss" in r]
    if val:
        a.plot(*zip(*val), marker="o", label="validation")
    a.set(xlabel="iteration", ylabel="loss (nats per token)", title="Loss")
    a.legend()
    b.plot(its, [r["tokens_per_s"] for r in recs])
    b.set(xlabel="iteration", ylabel="tokens / s", title="Throughput")
    b.set_ylim(bottom=0)  # a flat line stays flat
    for ax in (a, b):
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return f"plot: {os.path.abspath(png)} (loss and tokens/s against iteration)"


class LivePlot:
    """The run's plot (:func:`plot_run`), redrawn while the run goes so that it exists
    before the end; at most every ``min_interval_s`` seconds, as drawing costs a
    fraction of a second. A failure to draw never stops training."""

    def __init__(self, jsonl: str | None, min_interval_s: float = 10.0):
        self.jsonl, self.min_interval_s = jsonl, min_interval_s
        self._last = -float("inf")

    def draw(self) -> None:
        if not self.jsonl or time.monotonic() - self._last < self.min_interval_s:
            return
        self._last = time.monotonic()
        try:
            plot_run(self.jsonl)
        except Exception as e:  # a plot is a convenience: say why, keep training
            say(f"plot: not drawn ({type(e).__name__}: {e})")
            self.jsonl = None


# record key -> scalar name, as TensorBoard and W&B show them (grouped by prefix)
SCALARS = {
    "loss": "train/loss", "val_loss": "val/loss", "val_recall_acc": "val/recall_acc",
    "lr": "train/lr", "grad_norm": "train/grad_norm", "loss_scale": "train/loss_scale",
    "tokens_per_s": "perf/tokens_per_s", "tokens_per_s_per_rank": "perf/tokens_per_s_per_rank",
    "tflops_per_rank": "perf/tflops_per_rank", "tflops_total": "perf/tflops_total",
    "mfu": "perf/mfu",
    "step_time_s": "perf/step_time_s", "peak_mem_bytes": "perf/peak_mem_bytes",
    "consumed_tokens": "train/consumed_tokens",
}


class Scalars:
    """--tensorboard-dir (TensorBoard's own SummaryWriter) and --wandb-project: the
    iteration records as scalars, on rank 0 (``cfg`` None elsewhere: does nothing)."""

    def __init__(self, cfg: Any | None):
        self._tb: Any = None
        self._wandb: Any = None
        if cfg is None:
            return
        if cfg.logging.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=cfg.logging.tensorboard_dir)
            self._tb.add_text("config", "```\n" + json.dumps(cfg.to_dict(), indent=1) + "\n```")
        if cfg.logging.wandb_project:
            import wandb

            self._wandb = wandb.init(project=cfg.logging.wandb_project,
                                     name=cfg.logging.wandb_exp_name, config=cfg.to_dict())

    def write(self, rec: dict[str, Any]) -> None:
        values = {name: float(rec[k]) for k, name in SCALARS.items()
                  if k in rec and rec[k] is not None}
        step = int(rec["iteration"])
        if self._tb is not None:
            for name, v in values.items():
                self._tb.add_scalar(name, v, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


class JsonlLog:
    """Appends one JSON object per line and flushes, so a crash loses at most one line."""

    def __init__(self, path: str | None):
        self._f: TextIO | None = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._f = open(path, "a")  # noqa: SIM115 -- lives as long as the run

    def write(self, rec: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps(rec) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def say(msg: str, stream: TextIO | None = None) -> None:
    """Print and flush (torchrun pipes stdout; unflushed lines vanish on a crash). The
    default is the sys.stdout of the call, not of the import (a test's capture closes)."""
    print(msg, file=stream if stream is not None else sys.stdout, flush=True)

"""Progress lines (rank 0), JSONL records, and peak memory per rank."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any, TextIO

import torch


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


def current_rss_bytes() -> int:
    """Resident memory now (Linux /proc), 0 where unavailable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


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
    return (
        f"iter {rec['iteration']:>5}/{train_iters} | loss {rec['loss']:.4f} | "
        f"lr {rec['lr']:.2e} | grad-norm {rec['grad_norm']:.3f} | "
        f"{rec['tokens_per_s']:,.0f} tok/s | step {rec['step_time_s']:.2f} s | "
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
        import matplotlib
    except ImportError:
        return 'plot: skipped, matplotlib is not installed (pip install "hla-sp[plot]")'
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def say(msg: str, stream: TextIO = sys.stdout) -> None:
    """Print and flush (torchrun pipes stdout; unflushed lines vanish on a crash)."""
    print(msg, file=stream, flush=True)

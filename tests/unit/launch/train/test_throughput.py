"""Throughput per rank with the job's total beside it, and MFU against a known peak."""

from __future__ import annotations

import pytest
from hla_sp.launch.train import metrics
from hla_sp.launch.train.throughput import default_peak, step_throughput


def test_per_rank_figures_are_the_jobs_over_the_world_size() -> None:
    t = step_throughput(flops_per_step=8e12, tokens=4096, seconds=2.0, world_size=16,
                        peak_tflops=None)
    assert t["tflops_total"] == pytest.approx(4.0)
    assert t["tflops_per_rank"] == pytest.approx(0.25)
    assert t["tokens_per_s"] == pytest.approx(2048.0)
    assert t["tokens_per_s_per_rank"] == pytest.approx(128.0)
    assert "mfu" not in t


def test_mfu_is_the_ranks_tflops_over_the_peak() -> None:
    t = step_throughput(flops_per_step=989e12 * 8 * 0.4, tokens=1, seconds=1.0, world_size=8,
                        peak_tflops=989.0)
    assert t["mfu"] == pytest.approx(0.4)


@pytest.mark.parametrize(("name", "half", "peak"), [
    ("NVIDIA H200", True, 989.0), ("NVIDIA H100 80GB HBM3", False, 494.7),
    ("NVIDIA A100-SXM4-80GB", True, 312.0), ("NVIDIA GeForce RTX 4090", True, None),
    (None, True, None),
])
def test_default_peak_by_device_name(name: str | None, half: bool, peak: float | None) -> None:
    assert default_peak(name, half) == peak


def test_every_sink_shows_the_per_rank_figures_and_the_total() -> None:
    rec = {"iteration": 3, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "step_time_s": 2.0,
           "peak_mem_bytes": 2**30, "peak_mem_bytes_per_rank": [2**30] * 16,
           **step_throughput(8e12, 4096, 2.0, 16, 989.0)}
    line = metrics.progress_line(rec, 10)
    assert "2,048 tok/s (128 per rank)" in line
    assert "0.25 TFLOP/s per rank (4 total)" in line and "MFU 0.0%" in line
    for key in ("tflops_per_rank", "tflops_total", "tokens_per_s_per_rank", "mfu"):
        assert key in metrics.SCALARS  # TensorBoard and W&B names


def test_peak_is_the_flag_else_a_known_gpus_else_none() -> None:
    import torch
    from hla_sp.launch.train.throughput import peak_tflops

    assert peak_tflops(123.0, torch.device("cpu"), True) == 123.0
    assert peak_tflops(None, torch.device("cpu"), True) is None

"""Throughput figures a dashboard can compare across job sizes: per rank, with the
job's total beside each, and model FLOPs utilisation (MFU) against the device's peak.

The model FLOPs of a step are the job's (every rank's share of the global batch, the
recomputation of --recompute-granularity not counted, as Megatron counts them); a rank's
figure is that over the world size. MFU is the rank's TFLOP/s over ``--peak-tflops``,
by default the dense peak of a known GPU at the run's precision (:data:`PEAK_TFLOPS`);
on a CPU or an unknown device there is no default, and no MFU without the flag.
"""

from __future__ import annotations

from typing import Any

# Dense tensor-core peaks in TFLOP/s by GPU name: (bf16/fp16, tf32 for an fp32 run).
PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "H200": (989.0, 494.7),
    "H100": (989.0, 494.7),
    "A100": (312.0, 156.0),
}


def default_peak(device_name: str | None, half: bool) -> float | None:
    """The table's peak for a device name (``torch.cuda.get_device_name()``), at half
    precision (``--bf16``/``--fp16``) or fp32 (tf32), or None when it is not known."""
    if not device_name:
        return None
    for key, (half_peak, tf32_peak) in PEAK_TFLOPS.items():
        if key in device_name.upper():
            return half_peak if half else tf32_peak
    return None


def peak_tflops(given: float | None, device: Any, half: bool) -> float | None:
    """``--peak-tflops`` if given, else the table's peak for a CUDA ``device`` (a
    ``torch.device``), else None."""
    if given:
        return given
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    return default_peak(torch.cuda.get_device_name(device), half)


def step_throughput(flops_per_step: float, tokens: int, seconds: float, world_size: int,
                    peak_tflops: float | None) -> dict[str, Any]:
    """The iteration record's throughput: TFLOP/s and tokens/s per rank and in total, and
    MFU (a fraction) where a peak is known."""
    total = flops_per_step / seconds / 1e12
    per_rank = total / world_size
    out: dict[str, Any] = {
        "tflops_per_rank": per_rank,
        "tflops_total": total,
        "tokens_per_s_per_rank": tokens / seconds / world_size,
        "tokens_per_s": tokens / seconds,
    }
    if peak_tflops:
        out["mfu"] = per_rank / peak_tflops
        out["peak_tflops"] = peak_tflops
    return out

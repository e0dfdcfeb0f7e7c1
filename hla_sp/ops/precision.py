"""The dtypes the operators compute in and pass between their stages.

The primitive always accumulates in fp32 (fp64 for fp64 inputs). What differs is what
the higher-order compositions hand from one stage to the next (q, k, v and the
intermediates k~ = S q, u = C^T q):

- ``"exact"``: the compute dtype. 16-bit inputs are rounded once, at the output; every
  stage of a bf16 model runs fp32 kernels.
- ``"fast"``: 16-bit inputs stay 16-bit. Every stage reads 16-bit operands, accumulates
  in fp32 and rounds its output once, so k~ and u are rounded once per stage. On a GPU
  this runs the 16-bit kernels (tensor-core dots, half the bytes, no register spills);
  the error is that of one bf16 rounding per stage (tests/test_precision.py bounds it).
- ``"auto"`` (default): fast for 16-bit inputs on CUDA, exact everywhere else (CPU, the
  interpreter, fp32 and fp64 inputs).
"""

from __future__ import annotations

import torch

from hla_sp.config import PRECISIONS

LOW_PRECISION = (torch.bfloat16, torch.float16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; every other dtype accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def resolve(precision: object, dtype: torch.dtype, device: torch.device) -> str:
    """``precision`` ("auto" | "exact" | "fast") for inputs of ``dtype`` on ``device``:
    "exact" or "fast" ("fast" only for 16-bit inputs, where it differs)."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    if dtype not in LOW_PRECISION:
        return "exact"  # fp32 and fp64 stages are the exact path already
    if precision == "auto":
        return "fast" if device.type == "cuda" else "exact"
    return precision


def stage_dtype(precision: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the tensors between stages for a :func:`resolve` d ``precision``."""
    return dtype if precision == "fast" else compute_dtype(dtype)

"""The one place that chooses how an operator runs: its backend and its precision.

Backend: this is the one module that imports the kernels.

``HLA_SP_BACKEND`` = ``auto`` (default: Triton for CUDA tensors of fp32/fp16/bf16,
PyTorch otherwise, fp64 included: the Triton path keeps fp32 states), ``torch`` or
``triton``. Forcing ``triton`` where it cannot run (no triton, CPU tensors without
``TRITON_INTERPRET=1``, fp64) is an error, never a silent fallback.

``hla_sp.kernels`` is imported here only, lazily (importing it needs triton), and
only through the ``triton_*`` functions below; the autograd glue around them is
:mod:`hla_sp.ops.primitive` and :mod:`hla_sp.ops.fused` (hla2).

Precision: the dtypes the operators compute in and pass between their stages.

The primitive always accumulates in fp32 (fp64 for fp64 inputs). What differs is what
the higher-order compositions hand from one stage to the next (q, k, v and the
intermediates k~ = S q, u = C^T q):

- ``"exact"``: the compute dtype. 16-bit inputs are rounded once, at the output; every
  stage of a bf16 model runs fp32 kernels.
- ``"fast"``: 16-bit inputs stay 16-bit. Every stage reads 16-bit operands, accumulates
  in fp32 and rounds its output once, so k~ and u are rounded once per stage. On a GPU
  this runs the 16-bit kernels (tensor-core dots, half the bytes, no register spills);
  the error is that of one bf16 rounding per stage (tests/unit/ops/test_precision.py bounds it).
- ``"auto"`` (default): fast for 16-bit inputs on CUDA, exact everywhere else (CPU, the
  interpreter, fp32 and fp64 inputs).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hla_sp.config import PRECISIONS

BACKENDS = ("auto", "torch", "triton")
Tensor = torch.Tensor


def backend() -> str:
    """The backend asked for by ``HLA_SP_BACKEND``."""
    name = os.environ.get("HLA_SP_BACKEND", "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"HLA_SP_BACKEND: expected one of {BACKENDS}, got {name!r}")
    return name


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """``HLA_SP_BACKEND=name`` for the duration of a block (the caller's value after)."""
    if name not in BACKENDS:
        raise ValueError(f"name: expected one of {BACKENDS}, got {name!r}")
    before = os.environ.get("HLA_SP_BACKEND")
    os.environ["HLA_SP_BACKEND"] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HLA_SP_BACKEND", None)
        else:
            os.environ["HLA_SP_BACKEND"] = before


TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_unavailable_reason(
    device: torch.device, dtype: torch.dtype | None = None
) -> str | None:
    """None when the Triton kernels can run on ``device`` (and ``dtype``), else why not."""
    if dtype is not None and dtype not in TRITON_DTYPES:
        return f"the Triton kernels take float32, float16 or bfloat16 inputs, got {dtype}"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not installed ({e})"
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        from hla_sp.kernels import interpreter_mismatch

        return interpreter_mismatch()
    return f"tensors are on {device.type} and TRITON_INTERPRET=1 is not set"


def backend_for(x: torch.Tensor) -> str:
    """``"torch"`` or ``"triton"``: the backend that runs for tensors like ``x``."""
    name = backend()
    if name == "auto":
        ok = x.is_cuda and triton_unavailable_reason(x.device, x.dtype) is None
        return "triton" if ok else "torch"
    if name == "triton":
        reason = triton_unavailable_reason(x.device, x.dtype)
        if reason is not None:
            raise RuntimeError(f"HLA_SP_BACKEND=triton was asked for, but {reason}")
    return name


def triton_chunk_forward(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, resets: Tensor | None,
    h0: Tensor | None, chunk_size: int, scale: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`hla_sp.kernels.chunk.chunk_forward`: o [B, T, H, V], h_last [B, H, K, V]
    fp32, isolated; and the flags [B, T + 2, H] int32 its backward takes."""
    from hla_sp.kernels import chunk_forward, new_flags

    flags = new_flags(k.shape[0], k.shape[1], k.shape[2], k.device)
    o, h = chunk_forward(q, k, v, g, resets, h0, chunk_size, flags, scale)
    return o, h, flags


def triton_chunk_backward(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, resets: Tensor | None,
    h0: Tensor | None, do: Tensor, dht: Tensor | None, chunk_size: int, flags: Tensor,
    scale: float = 1.0, v_is_k: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """:func:`hla_sp.kernels.chunk.chunk_backward`: dq, dk, dv (None when ``v_is_k``: in
    dk), dg (fp32 or None), dh0, isolated by the forward's ``flags``."""
    from hla_sp.kernels import chunk_backward

    return chunk_backward(q, k, v, g, resets, h0, do, dht, chunk_size, flags, scale, v_is_k)


def triton_fused_hla2_forward(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, resets: Tensor | None,
    S0: Tensor | None, H0: Tensor | None, ridge: float, chunk_size: int, mode: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`hla_sp.kernels.hla2_fused.fused_hla2_forward`: o, S_T, H_T, all fp32."""
    from hla_sp.kernels import fused_hla2_forward

    return fused_hla2_forward(q, k, v, g, resets, S0, H0, ridge, chunk_size, mode)


def triton_fused_hla2_refusal(
    dtype: torch.dtype, K: int, V: int, decay: bool, documents: bool, states: bool
) -> str | None:
    """:func:`hla_sp.kernels.hla2_fused.sequential_refusal`: why the sequential fused
    kernel refuses these inputs (decided ahead of time, launching nothing), or None."""
    from hla_sp.kernels import sequential_refusal

    return sequential_refusal(dtype, K, V, decay, documents, states)


def triton_fused_hla2_backward(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, resets: Tensor | None,
    S0: Tensor | None, H0: Tensor | None, ridge: float, do: Tensor, dS_T: Tensor | None,
    dH_T: Tensor | None, chunk_size: int,
) -> tuple[Tensor | None, ...]:
    """:func:`hla_sp.kernels.hla2_fused.fused_hla2_backward`: dq, dk, dv, dg, dS0, dH0."""
    from hla_sp.kernels import fused_hla2_backward

    return fused_hla2_backward(q, k, v, g, resets, S0, H0, ridge, do, dS_T, dH_T, chunk_size)


# --- precision ------------------------------------------------------------

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

"""The one place that chooses how the primitive's chunk scan is computed.

``HLA_SP_BACKEND`` = ``auto`` (default: Triton for CUDA tensors of fp32/fp16/bf16,
PyTorch otherwise, fp64 included: the Triton path keeps fp32 states), ``torch`` or
``triton``. Forcing ``triton`` where it cannot run (no triton, CPU tensors without
``TRITON_INTERPRET=1``, fp64) is an error, never a silent fallback. Every
implementation has the signature of :func:`hla_sp.ops.chunk.chunk_linear_attention`.

While ``torch.compile`` traces, the chosen backend runs through the custom operator
of :mod:`hla_sp.ops.custom_op`, so the primitive is one graph node with a registered
backward; eager calls use the implementations directly.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from hla_sp.ops.chunk import chunk_linear_attention

BACKENDS = ("auto", "torch", "triton")
ChunkImpl = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def backend() -> str:
    """The backend asked for by ``HLA_SP_BACKEND``."""
    name = os.environ.get("HLA_SP_BACKEND", "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"HLA_SP_BACKEND: expected one of {BACKENDS}, got {name!r}")
    return name


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
        from hla_sp.kernels._jit import interpreter_mismatch

        return interpreter_mismatch()
    return f"tensors are on {device.type} and TRITON_INTERPRET=1 is not set"


def chunk_impl(x: torch.Tensor) -> ChunkImpl:
    """The chunk-scan implementation for tensors like ``x``."""
    name = backend_for(x)
    if torch.compiler.is_compiling():
        from hla_sp.ops.custom_op import make_chunk_impl

        return make_chunk_impl(name)
    if name == "torch":
        return chunk_linear_attention
    from hla_sp.kernels import chunk_linear_attention_triton

    return chunk_linear_attention_triton


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

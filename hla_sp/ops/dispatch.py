"""The one place that chooses how the primitive's chunk scan is computed.

``HLA_SP_BACKEND`` = ``auto`` (default: Triton for CUDA tensors, PyTorch otherwise),
``torch`` or ``triton``. Forcing ``triton`` where it cannot run is an error, never a
silent fallback. Every implementation has the signature of
:func:`hla_sp.ops.chunk.chunk_linear_attention`.
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


def triton_unavailable_reason(device: torch.device) -> str | None:
    """None when the Triton kernels can run on ``device``, else why not."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not installed ({e})"
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"tensors are on {device.type} and TRITON_INTERPRET=1 is not set"


def chunk_impl(x: torch.Tensor) -> ChunkImpl:
    """The chunk-scan implementation for tensors like ``x``."""
    name = backend()
    if name == "auto":
        name = "triton" if x.is_cuda and triton_unavailable_reason(x.device) is None else "torch"
    if name == "torch":
        return chunk_linear_attention
    reason = triton_unavailable_reason(x.device)
    if reason is not None:
        raise RuntimeError(f"HLA_SP_BACKEND=triton was asked for, but {reason}")
    from hla_sp.kernels import chunk_linear_attention_triton

    return chunk_linear_attention_triton

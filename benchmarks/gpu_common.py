"""What the GPU lease's benchmarks share: the shapes, the inputs, one step of each method.

A *method* is a forward + backward on the same inputs: ours (``la`` with a per-head
decay, ``la_g`` with a per-token one, ``kernels_g``: the Triton kernels alone, without
the operator's validation, isolation and autograd), fla's ``chunk_simple_gla`` (with
``g_gamma`` and with ``g``), ``hla2`` and causal SDPA on the flash backend. fla is the
wheel ``make gpu-wheels`` keeps in ``.whl/``; without it the fla methods are absent and
say why.

Importing this module with ``--dry-run`` on the command line sets ``TRITON_INTERPRET=1``
first (before torch and triton load), so the dry run needs no GPU.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

import hla_sp

Step = Callable[[], None]


@dataclass(frozen=True)
class Shape:
    """One input shape: B, T, H (q = k = v heads), K = V."""

    B: int
    T: int
    H: int
    K: int

    @property
    def label(self) -> str:
        return f"B{self.B} T{self.T} H{self.H} K{self.K}"


# The shapes: ours at H 16, and fla's anchor (B 1, T 8192, H 96, D 128).
GPU_SHAPES = (Shape(1, 8192, 16, 128), Shape(1, 32768, 16, 128), Shape(1, 8192, 96, 128))
DRY_SHAPES = (Shape(1, 32, 1, 16),)


def setup(dry_run: bool, dry_backend: str = "triton") -> tuple[str, torch.dtype]:
    """(device, dtype) of the run: CUDA and bf16, or the CPU in fp32 on ``dry_backend``
    (the interpreter, or the kernel-free torch path where the kernels are not the point).
    Exits with one line when a GPU run finds no GPU."""
    os.environ["HLA_SP_BACKEND"] = "triton"
    if dry_run:
        os.environ["HLA_SP_BACKEND"] = dry_backend
        return "cpu", torch.float32
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: run on the GPU machine, or pass --dry-run")
    return "cuda", torch.bfloat16


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"


def fla_chunk_simple_gla() -> tuple[Callable[..., Any] | None, str | None]:
    """fla's chunk_simple_gla and None, or None and why it is missing."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as e:  # fla-core is optional: the peer's figures are then absent
        return None, f"{type(e).__name__}: {e}"[:200]
    return chunk_simple_gla, None


def kernel_entry() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Our kernels' forward and backward from unprepared tensors, without isolation (no
    flags: what the operator adds to them is what the 3% bound is about)."""
    from hla_sp.kernels import chunk_backward, chunk_forward

    return chunk_forward, chunk_backward


def inputs(s: Shape, device: str, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """q, k, v, do [B, T, H, K]; a [H] per-head and g [B, T, H] per-token log decays
    (fp32, as fla takes them), all leaves that take gradients where they can."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    q, k, v, do = (randn(s.B, s.T, s.H, s.K) for _ in range(4))
    k = k * s.K**-0.5  # keeps the states of order one, as a trained layer's norms do
    a = -0.05 * torch.rand(s.H, generator=gen, device=device)
    g = -0.05 * torch.rand(s.B, s.T, s.H, generator=gen, device=device)
    out = dict(q=q, k=k, v=v, a=a, g=g)
    for t in out.values():
        t.requires_grad_()
    return out | {"do": do}


def methods(x: dict[str, torch.Tensor], device: str) -> tuple[dict[str, Step], dict[str, str]]:
    """name -> one forward + backward step on ``x``; and name -> why a method is absent."""
    q, k, v, a, g, do = (x[n] for n in ("q", "k", "v", "a", "g", "do"))
    leaves = (q, k, v, a, g)

    def step(f: Callable[[], torch.Tensor]) -> Step:
        def go() -> None:
            for t in leaves:
                t.grad = None
            f().backward(do)

        return go

    steps: dict[str, Step] = {
        "la": step(lambda: hla_sp.linear_attention(q, k, v, log_decay=a)[0]),
        "la_g": step(lambda: hla_sp.linear_attention(q, k, v, log_decay=g)[0]),
        "hla2": step(lambda: hla_sp.hla2(q, k, v, log_decay=a)[0]),
    }
    missing: dict[str, str] = {}
    fwd, bwd = kernel_entry()

    def kernels() -> None:  # what the operator launches, without what wraps it
        # (q unscaled: the time is the same, and the scale is the kernels' to apply)
        with torch.no_grad():
            fwd(q, k, v, g, None, None, 64)
            bwd(q, k, v, g, None, None, do, None, 64)

    steps["kernels_g"] = kernels
    fla, why = fla_chunk_simple_gla()
    if fla is None:
        missing["fla_gamma"] = missing["fla_g"] = f"fla does not import ({why})"
    else:
        steps["fla_gamma"] = step(lambda: fla(q, k, v, g_gamma=a.detach())[0])
        steps["fla_g"] = step(lambda: fla(q, k, v, g=g)[0])
    if device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            return o.transpose(1, 2)

        steps["sdpa_flash"] = step(sdpa)
    else:
        missing["sdpa_flash"] = "flash attention needs CUDA"
    return steps, missing


def timer(device: str) -> Callable[[Step], float]:
    """Median ms of a step: triton's do_bench on CUDA; one call after a warm-up on CPU."""
    if device == "cuda":
        import triton.testing

        return lambda fn: float(triton.testing.do_bench(fn, warmup=25, rep=100))

    def once(fn: Step) -> float:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return once


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def write(path: Path, result: dict[str, Any]) -> None:
    """Write ``result`` as JSON (again after every row: a stage cut by its timeout keeps
    what it measured)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(path)


def header(device: str, dry_run: bool) -> dict[str, Any]:
    import triton

    fla, why = fla_chunk_simple_gla()
    fla_version = None
    if fla is not None:
        import fla as fla_pkg

        fla_version = getattr(fla_pkg, "__version__", "?")
    return dict(device=device_name(device), torch=torch.__version__, triton=triton.__version__,
                fla=fla_version, fla_missing=why, dry_run=dry_run,
                shapes=[asdict(s) for s in (DRY_SHAPES if dry_run else GPU_SHAPES)])

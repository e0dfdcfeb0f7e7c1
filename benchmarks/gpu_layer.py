"""One attention layer, forward + backward: hla_sp.nn.HLAttention against softmax.

x [1, T, 2048] -> HLAttention (16 heads of 128, its default options: hla2) -> y, and
the same projections around causal SDPA on the flash backend (the softmax layer a
model would otherwise use), bf16, T = 8k and 32k, ``do_bench`` medians; tokens/s and
TFLOP/s by :func:`hla_sp.launch.model.flops.attention_flops_per_token` plus the four
projections (2 FLOPs a multiply-add, training = 3x forward).

    python benchmarks/gpu_layer.py --out runs/gpu_lease/layer.json      (one GPU)
    python benchmarks/gpu_layer.py --dry-run --out /tmp/layer.json      (CPU)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import gpu_common as gc  # first: --dry-run sets TRITON_INTERPRET before torch loads
import torch
import torch.nn.functional as F
from hla_sp.launch.model.flops import attention_flops_per_token
from torch import nn

from hla_sp.nn import HLAttention


class SoftmaxLayer(nn.Module):
    """HLAttention's projections around causal SDPA (flash on CUDA)."""

    def __init__(self, hidden: int, heads: int, **fk: Any):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False, **fk)
        self.o = nn.Linear(hidden, hidden, bias=False, **fk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        if x.is_cuda:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(o.transpose(1, 2).reshape(B, T, D))


def layer_flops(kind: str, T: int, hidden: int, heads: int) -> float:
    """Training FLOPs of one layer call at B = 1: projections and core attention, 3x fwd."""
    proj = 2 * 4 * hidden * hidden  # q, k, v, o: 2 FLOPs a multiply-add
    core = attention_flops_per_token(kind, T, heads, heads, hidden // heads)
    return 3.0 * T * (proj + core)


def time_layer(layer: nn.Module, T: int, hidden: int, fk: dict[str, Any],
               bench: Any) -> tuple[float | None, str | None]:
    """(median ms of a forward + backward at [1, T, hidden], None) or (None, the error)."""
    x = torch.randn(1, T, hidden, **fk, requires_grad=True)
    dy = torch.randn(1, T, hidden, **fk)

    def step() -> None:
        x.grad = None
        layer.zero_grad(set_to_none=True)
        out = layer(x)
        (out[0] if isinstance(out, tuple) else out).backward(dy)

    try:
        return bench(step), None
    except Exception as e:  # one failure costs only its own figure
        return None, f"{type(e).__name__}: {e}"[:300]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU interpreter")
    p.add_argument("--out", type=Path, default=Path("runs/gpu_lease/layer.json"))
    a = p.parse_args()
    device, dtype = gc.setup(a.dry_run, dry_backend="torch")
    hidden, heads, Ts = (32, 2, (32,)) if a.dry_run else (2048, 16, (8192, 32768))
    result: dict[str, Any] = gc.header(device, a.dry_run) | dict(rows=[])
    bench = gc.timer(device)
    fk = dict(device=device, dtype=dtype)
    layers = {"hla2": HLAttention(hidden, heads, **fk),
              "softmax": SoftmaxLayer(hidden, heads, **fk)}
    for T in Ts:
        for kind, layer in layers.items():
            ms, err = time_layer(layer, T, hidden, fk, bench)
            fl = layer_flops(kind, T, hidden, heads)
            row = dict(layer=kind, T=T, hidden=hidden, heads=heads, ms=ms, error=err,
                       tokens_per_s=T / (ms / 1e3) if ms else None,
                       tflops=fl / (ms / 1e3) / 1e12 if ms else None)
            result["rows"].append(row)
            print(f"[layer] T={T:6d} {kind:8s} " + (f"{ms:9.3f} ms, {row['tokens_per_s']:,.0f} "
                  f"tokens/s, {row['tflops']:.1f} TFLOP/s" if ms else f"FAILED {err}"), flush=True)
            gc.write(a.out, result)
            gc.free(device)
    return 0 if all(r["ms"] for r in result["rows"] if r["layer"] == "hla2") else 1


if __name__ == "__main__":
    sys.exit(main())

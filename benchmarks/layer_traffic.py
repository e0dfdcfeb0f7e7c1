"""Memory traffic of one HLAttention layer's PyTorch operations, beside its kernels': a
model from the operations a forward and backward dispatches, not a GPU measurement.

One forward + backward of ``hla_sp.nn.HLAttention`` (its defaults: hla2, learned decay,
short convolution, qk-norm, output norm, the first-order path; bf16 inputs, the Triton
path under the launch capture, so its kernels are described, not run) runs under a
``TorchDispatchMode`` that records every PyTorch operation that moves data: the bytes of
its tensor arguments and results (views, allocations and the projections' matmuls left
out), each by the line of hla_sp that issued it (the backward's: the line of the forward
operation it differentiates, which anomaly mode records). Every such operation is
elementwise or a reduction over one token's channels, so the bytes per token do not
depend on T: they are scaled to T and set beside the roofline model's bytes for hla2's
Triton kernels (``roofline.py``) and the time both take at the H200's 4.8 TB/s. Counts
only: caches and fusion may move less, and PyTorch's elementwise kernels reach less than
the peak bandwidth.

    python benchmarks/layer_traffic.py [--out benchmarks/results/layer_traffic.json]

"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, HEADS, T_RECORD = 2048, 16, 256
# operations that move no data of their own (views, allocations) or that the softmax
# layer has too (the projections' matmuls)
NO_TRAFFIC = frozenset((
    "view", "_unsafe_view", "reshape", "as_strided", "transpose", "t", "permute", "expand",
    "unsqueeze", "squeeze", "slice", "select", "narrow", "detach", "alias", "empty",
    "empty_like", "new_empty", "empty_strided", "new_empty_strided", "unbind", "split",
    "split_with_sizes", "lift_fresh", "resolve_conj", "resolve_neg", "mm", "addmm", "bmm",
    "_reshape_alias", "_local_scalar_dense", "chunk_linear_attention",
    "chunk_linear_attention_bwd",
))

FACTORIES = frozenset(("new_zeros", "new_ones", "new_full", "zeros_like", "ones_like",
                       "full_like", "fill_", "zero_"))


def record(T: int = T_RECORD, hidden: int = HIDDEN, heads: int = HEADS) -> dict[str, Any]:
    """Bytes per token of one layer's forward and backward PyTorch operations:
    {"forward": {"op @ file:line": bytes}, "backward": {...}, "ops": counts}."""
    env = {n: os.environ.get(n) for n in ("TRITON_INTERPRET", "HLA_SP_BACKEND")}
    os.environ.update(TRITON_INTERPRET="1", HLA_SP_BACKEND="triton")
    try:
        return _record(T, hidden, heads)
    finally:  # the caller's settings (a test session's): nothing leaks into later calls
        for n, val in env.items():
            if val is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = val


def _record(T: int, hidden: int, heads: int) -> dict[str, Any]:
    import torch
    from hla_sp.kernels import _jit
    from torch.utils._python_dispatch import TorchDispatchMode

    from hla_sp.nn import HLAttention

    class Traffic(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bytes: dict[str, Counter[str]] = {"forward": Counter(), "backward": Counter()}
            self.ops: Counter[str] = Counter()
            self.phase = "forward"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            if name in NO_TRAFFIC:
                return out
            # a factory reads its argument's metadata only: its output is its traffic
            seen = [] if name in FACTORIES else \
                [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
            res = out if isinstance(out, (tuple, list)) else [out]
            seen += [r for r in res if isinstance(r, torch.Tensor)
                     and not any(r is a for a in seen)]
            moved = sum(t.numel() * t.element_size() for t in seen if t.numel() > 1)
            if self.phase == "forward":
                frames = [f"{f.filename}:{f.lineno}" for f in traceback.extract_stack()]
            else:  # the forward line of the autograd node running (anomaly mode keeps it)
                node = torch._C._current_autograd_node()
                tb = node.metadata.get("traceback_", []) if node is not None else []
                frames = [ln.split('"')[1] + ":" + ln.split("line ")[1].split(",")[0]
                          for ln in "".join(tb).splitlines() if ln.strip().startswith("File")]
            mine = [f.split("hla_sp/")[-1] for f in frames if "/hla_sp/" in f]
            where = f"{name} @ {mine[-1]}" if mine else name
            self.bytes[self.phase][where] += moved / T
            self.ops[self.phase] += 1
            return out

    torch.manual_seed(0)
    layer = HLAttention(hidden, heads, dtype=torch.bfloat16)
    x = torch.randn(1, T, hidden, dtype=torch.bfloat16, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anomaly mode's notice that it slows things down
        with _jit.capture(), torch.autograd.detect_anomaly(check_nan=False):
            mode = Traffic()
            with mode:
                y = layer(x)
                y = y[0] if isinstance(y, tuple) else y
                mode.phase = "backward"
                y.backward(torch.ones_like(y))
    return {"forward": dict(mode.bytes["forward"]), "backward": dict(mode.bytes["backward"]),
            "ops": dict(mode.ops)}


def report(per_token: dict[str, Any], hidden: int = HIDDEN, heads: int = HEADS,
           lengths: tuple[int, ...] = (8192, 32768)) -> dict[str, Any]:
    """Totals scaled to each T, beside the roofline's bytes for hla2's kernels."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import roofline as R

    bw = R.GPUS["H200"][1]
    fwd, bwd = (sum(per_token[p].values()) for p in ("forward", "backward"))
    conv = {p: sum(v for k, v in per_token[p].items() if "nn/conv.py" in k)
            for p in ("forward", "backward")}
    rows = []
    for T in lengths:
        K = hidden // heads
        kernels = sum(k.nbytes for b in (False, True) for k in R.hla2(1, T, heads, K, "H200", b))
        torch_bytes = (fwd + bwd) * T
        rows.append(dict(T=T, torch_gb=torch_bytes / 1e9, kernels_gb=kernels / 1e9,
                         torch_ms=1e3 * torch_bytes / bw, kernels_ms=1e3 * kernels / bw,
                         ratio=torch_bytes / kernels))
    top = sorted(per_token["forward"].items(), key=lambda kv: -kv[1])[:12]
    topb = sorted(per_token["backward"].items(), key=lambda kv: -kv[1])[:12]
    return dict(hidden=hidden, heads=heads, kb_per_token=dict(forward=fwd / 1e3,
                backward=bwd / 1e3, conv_forward=conv["forward"] / 1e3,
                conv_backward=conv["backward"] / 1e3), ops=per_token["ops"],
                rows=rows, forward_top=[(k, v / 1e3) for k, v in top],
                backward_top=[(k, v / 1e3) for k, v in topb])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/layer_traffic.json")
    p.add_argument("--T", type=int, default=T_RECORD, help="tokens of the recorded call")
    a = p.parse_args()
    r = report(record(a.T))
    kb = r["kb_per_token"]
    print(f"HLAttention(hidden {r['hidden']}, {r['heads']} heads), defaults, bf16: PyTorch "
          f"operations move {kb['forward']:.0f} KB a token forward ({r['ops']['forward']} ops; "
          f"the short convolution {kb['conv_forward']:.0f}) and {kb['backward']:.0f} KB "
          f"backward ({r['ops']['backward']} ops; the convolution {kb['conv_backward']:.0f})")
    print("| T | PyTorch ops (GB) | hla2 kernels, roofline (GB) | ratio | at 4.8 TB/s (ms) |")
    print("|---|---|---|---|---|")
    for row in r["rows"]:
        print(f"| {row['T']} | {row['torch_gb']:.1f} | {row['kernels_gb']:.1f} | "
              f"{row['ratio']:.1f} | {row['torch_ms']:.2f} against {row['kernels_ms']:.2f} |")
    for name in ("forward_top", "backward_top"):
        print(f"\n{name.split('_')[0]}, KB a token:")
        for k, v in r[name]:
            print(f"  {v:7.1f}  {k}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

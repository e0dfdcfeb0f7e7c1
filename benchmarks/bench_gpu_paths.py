"""The newer paths on a GPU, beside the plain ones they replace: time and peak memory.

- ``loss``: the chunked output projection + cross-entropy (``--loss-chunk-tokens``)
  against the plain path (all logits, then cross-entropy), forward and backward, bf16
  hidden states and weight, at one rank's share of the README's cluster command
  (65,536 tokens, width 2048, 50,257 ids padded to 50,304).
- ``gqa``: hla2 with 16 query heads over G-fold fewer kv heads against 16 over 16,
  forward and backward, bf16, B = 1, K = V = 128.

``bench_gpu.py`` runs both after its timings; ``--dry-run`` there runs them at toy sizes
on the CPU (so this code is exercised by the tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import hla_sp


def measure(fn: Callable[[], None], device: str, reps: int) -> tuple[float, float]:
    """(median ms, peak bytes above the start) of fn, after one warm-up call."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else float("nan")
    return sorted(times)[len(times) // 2], float(peak)


def loss_paths(device: str, tokens: int, width: int, vocab: int, padded: int,
               chunk: int, reps: int = 5) -> list[dict[str, Any]]:
    """Plain and chunked loss at ``tokens`` x ``width`` against ``padded`` output rows."""
    from hla_sp.launch.model.loss import chunked_cross_entropy

    dt = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    hidden = (torch.randn(tokens, 1, width, device=device, dtype=dt, generator=g)
              .requires_grad_())
    weight = (0.02 * torch.randn(padded, width, device=device, dtype=dt, generator=g)
              ).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), device=device, generator=g)

    def plain() -> None:
        hidden.grad = weight.grad = None
        logits = (hidden @ weight.t()).float()
        logits[..., vocab:] = float("-inf")  # padding ids, as the model masks them
        F.cross_entropy(logits.view(tokens, padded), labels.t().reshape(tokens),
                        reduction="none").sum().backward()

    def chunked() -> None:
        hidden.grad = weight.grad = None
        chunked_cross_entropy(hidden, weight, labels, chunk, vocab).sum().backward()

    rows = []
    for name, fn in (("plain", plain), ("chunked", chunked)):
        ms, peak = measure(fn, device, reps)
        rows.append(dict(path=f"loss_{name}", tokens=tokens, width=width, vocab=padded,
                         chunk=chunk if name == "chunked" else None, ms=ms, peak_bytes=peak))
        print(f"[loss] {name:8s} {tokens} tokens x {padded} ids: {ms:8.2f} ms, "
              f"peak {peak / 2**30:6.2f} GiB", flush=True)
    return rows


def gqa_paths(device: str, T: int, Hq: int, K: int, groups: tuple[int, ...],
              reps: int = 5) -> list[dict[str, Any]]:
    """hla2 at Hq query heads over Hq / G kv heads, for each G; ratio to G = 1."""
    dt = torch.bfloat16
    rows: list[dict[str, Any]] = []
    for G in groups:
        Hkv = Hq // G
        q = torch.randn(1, T, Hq, K, device=device, dtype=dt, requires_grad=True)
        k = torch.randn(1, T, Hkv, K, device=device, dtype=dt, requires_grad=True)
        v = torch.randn(1, T, Hkv, K, device=device, dtype=dt, requires_grad=True)
        do = torch.randn(1, T, Hq, K, device=device, dtype=dt)

        def step(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v,
                 do: torch.Tensor = do) -> None:
            for t in (q, k, v):
                t.grad = None
            hla_sp.hla2(q, k, v)[0].backward(do)

        ms, peak = measure(step, device, reps)
        rows.append(dict(path="gqa_hla2", T=T, Hq=Hq, Hkv=Hkv, G=G, K=K, ms=ms,
                         peak_bytes=peak))
    base = rows[0]["ms"]
    for r in rows:
        r["ratio_to_G1"] = r["ms"] / base
        print(f"[gqa] hla2 T={T} {r['Hq']} over {r['Hkv']} kv heads: {r['ms']:8.2f} ms "
              f"({r['ratio_to_G1']:.2f}x of {Hq} over {Hq})", flush=True)
    return rows


def run(device: str, dry_run: bool) -> dict[str, list[dict[str, Any]]]:
    """Both comparisons at the GPU sizes, or at toy sizes on the CPU."""
    if dry_run:
        return {"loss": loss_paths(device, 64, 16, 50, 56, chunk=16, reps=1),
                "gqa": gqa_paths(device, 32, 4, 8, (1, 2, 4), reps=1)}
    out = {"loss": loss_paths(device, 65536, 2048, 50257, 50304, chunk=4096)}
    torch.cuda.empty_cache()
    out["gqa"] = gqa_paths(device, 32768, 16, 128, (1, 2, 4, 8))
    return out

"""Roofline model of hla2 on the Triton kernels (a model, not a measurement).

B = 1, H = 16, K = V = 128, bf16 inputs, fp32 states and outputs, the launch shapes of
``hla_sp.kernels.chunk.tiling`` for bf16: chunk 64, 32-wide K/V tiles, 16-wide K tiles
in dq/dk. Each kernel's time is max(FLOPs / peak, bytes / bandwidth, serial chunk
steps x STEP); the script prints the markdown tables of docs/benchmarks.md.
Usage: ``python benchmarks/roofline.py``.
"""

from __future__ import annotations

GPUS = {"H200": (989e12, 4.8e12), "H100 SXM": (989e12, 3.35e12)}  # bf16 FLOP/s, B/s
H, K, V, BT, BKV, BKN = 16, 128, 128, 64, 32, 16
STEP = 0.7e-6  # one dependent chunk step of the state passing (load + store), assumed
E = 2  # bytes per bf16 element; states and outputs are fp32 (4)

Kernel = tuple[str, float, float, int]  # name, FLOPs, bytes, serial steps


def primitive(T: int, Vd: int, bwd: bool = False) -> list[Kernel]:
    """Kernels of one primitive call (all heads): forward, or backward with recompute."""
    N, NK, NV = T // BT, K // BKV, Vd // BKV
    NKN = K // BKN  # dq/dk's K blocks: each recomputes do v^T
    ks = [
        ("chunk_state", 2 * BT * K * Vd * N * H,
         (N * BT * (K + Vd) * E * max(NK, NV) + N * K * Vd * 4) * H, 0),
        ("state_passing", 2 * K * Vd * N * H, 2 * N * K * Vd * 4 * H, N),
    ]
    if not bwd:
        flops = (2 * BT * BT * K * NV + 2 * BT * K * Vd + 2 * BT * BT * Vd) * N * H
        nbytes = (N * BT * 2 * K * E * NV + N * BT * Vd * E + N * K * Vd * 4
                  + N * BT * Vd * 4) * H
        ks.append(("chunk_fwd_o", flops, nbytes, 0))
        return ks
    ks += [
        ("chunk_state (dh; h recomputed)", 2 * 2 * BT * K * Vd * N * H,
         2 * (N * BT * (K + Vd) * E * max(NK, NV) + N * K * Vd * 4) * H, 0),
        ("state_passing (reverse)", 2 * K * Vd * N * H, 2 * N * K * Vd * 4 * H, N),
        ("chunk_bwd_dv", (2 * BT * BT * K * NV + 2 * BT * K * Vd + 2 * BT * BT * Vd) * N * H,
         (N * BT * 2 * K * E * NV + N * BT * Vd * E * 2 + N * K * Vd * 4) * H, 0),
        ("chunk_bwd_dqk", (2 * BT * BT * Vd * NKN + 4 * BT * Vd * K + 4 * BT * BT * K) * N * H,
         (N * BT * 2 * Vd * E * NKN + 2 * N * K * Vd * 4 + N * BT * 2 * K * E * 2
          + N * BT * 4 * NKN) * H, 0),
    ]
    return ks


def times(ks: list[Kernel], peak: float, bw: float) -> tuple[float, list[tuple]]:
    """Total predicted seconds and per kernel (name, FLOPs, bytes, seconds, limit)."""
    total, rows = 0.0, []
    for name, f, b, steps in ks:
        tc, tm, ts = f / peak, b / bw, steps * STEP
        t = max(tc, tm, ts)
        total += t
        limit = "compute" if t == tc else ("memory" if t == tm else "latency (serial chunks)")
        rows.append((name, f, b, t, limit))
    return total, rows


def main() -> None:
    print("| T | GPU | hla2 fwd (ms) | hla2 fwd+bwd (ms) | FLOPs fwd+bwd | bytes fwd+bwd "
          "| flash attention, causal fwd+bwd at 60% of peak (ms) |")
    print("|---|---|---|---|---|---|---|")
    for T in (8192, 32768, 131072):
        for gpu, (peak, bw) in GPUS.items():
            fwd = primitive(T, K) + primitive(T, V)  # stage 1 (values k), stage 2
            bwd = primitive(T, K, True) + primitive(T, V, True) + primitive(T, K)  # + k~
            tf, _ = times(fwd, peak, bw)
            tb, _ = times(bwd, peak, bw)
            flops = sum(k[1] for k in fwd + bwd)
            nbytes = sum(k[2] for k in fwd + bwd)
            fa = 7 * T * T * K * H / (0.6 * peak)
            print(f"| {T // 1024}k | {gpu} | {tf * 1e3:.3f} | {(tf + tb) * 1e3:.3f} "
                  f"| {flops / 1e12:.2f} T | {nbytes / 1e9:.2f} GB | {fa * 1e3:.2f} |")
    print()
    print("| kernel (one primitive call, T=32k, H200) | GFLOP | MB moved | predicted (us) "
          "| binding limit |")
    print("|---|---|---|---|---|")
    peak, bw = GPUS["H200"]
    rows = times(primitive(32768, V), peak, bw)[1] + times(primitive(32768, V, True), peak, bw)[1]
    for name, f, b, t, limit in rows:
        print(f"| {name} | {f / 1e9:.1f} | {b / 1e6:.1f} | {t * 1e6:.1f} | {limit} |")


if __name__ == "__main__":
    main()

"""Traffic: bytes each rank sends per hla2 layer (forward + backward), measured.

Against T at fixed P (flat), and against P at fixed T, for every exchange method and
both layouts; beside it the activation traffic of ring attention (softmax context
parallelism) at the same T, P, H, K, and the ratio at T = 1M, P = 8.

    python benchmarks/bench_sp_traffic.py       # -> runs/bench/sp_traffic.{json,png}
    python benchmarks/bench_sp_traffic.py --out benchmarks/results   # the committed figures

Ring attention (per rank, per layer): forward, P-1 steps each sending the local K,V
block, (T/P) H (K+V) elements; backward, the K,V block again plus the dK,dV
accumulators, twice that. Total 3 (P-1) (T/P) H (K+V) elements, counted in bf16
(2 bytes), which favours ring attention. hla2 summaries travel in fp32.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sp_common import RESULTS, save, traffic_task

from hla_sp.config import SP_METHODS
from hla_sp.testing import World

METHODS = SP_METHODS
LAYOUTS = ("contiguous", "zigzag")


def ring_attention_bytes(T: int, P: int, H: int, K: int, V: int, elem: int = 2) -> int:
    """Bytes per rank per layer (fwd + bwd) of ring attention for softmax CP."""
    return 3 * (P - 1) * (T // P) * H * (K + V) * elem


def measure(world: World, T: int, H: int, K: int, V: int) -> dict[str, list[int]]:
    """'layout/method' -> bytes sent per rank (list over ranks)."""
    out = {}
    for layout in LAYOUTS:
        for method in METHODS:
            per_rank = world.run(traffic_task, T, H, K, V, method, layout, timeout=600)
            out[f"{layout}/{method}"] = [t["total"] for t in per_rank]
    return out


def main() -> None:
    H, K, V = 2, 16, 16
    Ts = [1024, 4096, 16384, 65536]
    Ps = [2, 4, 8]
    data: dict = {"config": {"op": "hla2", "H": H, "K": K, "V": V, "dtype": "float32",
                             "unit": "bytes sent per rank per layer, fwd+bwd (max over ranks)"}}
    vs_T: dict[str, dict] = {}
    with World(4) as w:
        for T in Ts:
            vs_T[str(T)] = measure(w, T, H, K, V)
    vs_P: dict[str, dict] = {}
    for P in Ps:
        with World(P) as w:
            vs_P[str(P)] = measure(w, 4096, H, K, V)
        if P == 8:
            # A realistic head size, measured at small T (the traffic does not depend on T).
            with World(P) as w:
                big = measure(w, 2 * P * 64, 16, 128, 128)
    data["vs_T_P4"] = vs_T
    data["vs_P_T4096"] = vs_P
    data["ring_attention_vs_T_P4"] = {str(T): ring_attention_bytes(T, 4, H, K, V) for T in Ts}
    data["ring_attention_vs_P_T4096"] = {str(P): ring_attention_bytes(4096, P, H, K, V)
                                         for P in Ps}
    T1M, P8 = 1 << 20, 8
    ratios = {}
    for cfg, meas, (h, k, v) in (("H2_K16", vs_P["8"], (H, K, V)),
                                 ("H16_K128", big, (16, 128, 128))):
        ra = ring_attention_bytes(T1M, P8, h, k, v)
        ratios[cfg] = {
            "ring_attention_bytes": ra,
            **{name: {"hla_bytes": max(b), "ring_attention_over_hla": ra / max(b)}
               for name, b in meas.items()},
        }
    data["ratio_T1M_P8"] = ratios
    path = save("sp_traffic", data)
    print(f"wrote {path}")
    for cfg, r in ratios.items():
        ag = r["contiguous/allgather"]
        print(f"T=1M P=8 {cfg}: ring attention {r['ring_attention_bytes'] / 2**20:.1f} MiB, "
              f"hla2 allgather {ag['hla_bytes'] / 2**20:.3f} MiB, "
              f"ratio {ag['ring_attention_over_hla']:.0f}x")
    plot(data, Ts, Ps)


def plot(data: dict, Ts: list[int], Ps: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in data["vs_T_P4"][str(Ts[0])]:
        axes[0].plot(Ts, [max(data["vs_T_P4"][str(T)][name]) for T in Ts], "o-", label=name)
        axes[1].plot(Ps, [max(data["vs_P_T4096"][str(P)][name]) for P in Ps], "o-", label=name)
    axes[0].plot(Ts, [data["ring_attention_vs_T_P4"][str(T)] for T in Ts], "k--",
                 label="ring attention (softmax CP)")
    axes[1].plot(Ps, [data["ring_attention_vs_P_T4096"][str(P)] for P in Ps], "k--",
                 label="ring attention (softmax CP)")
    cfg = data["config"]
    axes[0].set(xscale="log", yscale="log", xlabel="T (P = 4)", ylabel="bytes sent per rank",
                title=f"hla2 fwd+bwd, H={cfg['H']} K=V={cfg['K']}")
    axes[1].set(yscale="log", xlabel="P (T = 4096)", title="against P")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "sp_traffic.png", dpi=120)


if __name__ == "__main__":
    main()

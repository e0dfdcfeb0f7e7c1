"""Overhead: sharded hla2 time / single-rank time on the same T/P tokens, per method.

At fixed T/P, for P = 1, 2, 4. Both times are taken in the same world at the same
moment on every rank (so both meet the same CPU contention; with more ranks than
cores the absolute times grow, the ratio is what is compared). Also reported: the
forward with the overlap switched off and the exchange alone, giving the share of
the exchange that the overlap hides:

    hidden = (fwd_no_overlap - fwd) / exchange_alone     (clipped to [0, 1])

    python benchmarks/bench_sp_overhead.py      # -> benchmarks/results/sp_overhead.{json,png}
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sp_common import RESULTS, save, timing_task

from hla_sp.testing import World

METHODS = ["allgather", "ring", "tree"]


def main(T_local: int = 8192, H: int = 2, K: int = 32, V: int = 32, reps: int = 5) -> None:
    data: dict = {"config": {"op": "hla2", "T_local": T_local, "H": H, "K": K, "V": V,
                             "dtype": "float32", "reps": reps, "stat": "median, max over ranks"},
                  "P": {}}
    for P in (1, 2, 4):
        with World(P) as w:
            per_rank = w.run(timing_task, T_local, H, K, V, METHODS, reps, timeout=1800)
        # The step time of a group is its slowest rank.
        agg = {"local_fwd": max(r["local_fwd"] for r in per_rank),
               "local_fwd_bwd": max(r["local_fwd_bwd"] for r in per_rank)}
        for m in METHODS:
            t = {key: max(r[m][key] for r in per_rank) for key in per_rank[0][m]}
            t["ratio_fwd_bwd"] = t["fwd_bwd"] / agg["local_fwd_bwd"]
            t["ratio_fwd"] = t["fwd"] / agg["local_fwd"]
            t["hidden_share"] = (
                min(1.0, max(0.0, (t["fwd_no_overlap"] - t["fwd"]) / t["exchange_alone"]))
                if t["exchange_alone"] > 0 else None
            )
            agg[m] = t
        data["P"][str(P)] = agg
        print(f"P={P}: " + ", ".join(
            f"{m} fwd+bwd x{agg[m]['ratio_fwd_bwd']:.3f} fwd x{agg[m]['ratio_fwd']:.3f} "
            f"(exchange {agg[m]['exchange_alone'] * 1e3:.2f} ms)" for m in METHODS), flush=True)
    path = save("sp_overhead", data)
    print(f"wrote {path}")
    plot(data)


def plot(data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ps = sorted(int(p) for p in data["P"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in METHODS:
        ax.plot(Ps, [data["P"][str(P)][m]["ratio_fwd_bwd"] for P in Ps], "o-",
                label=f"{m} fwd+bwd")
        ax.plot(Ps, [data["P"][str(P)][m]["ratio_fwd"] for P in Ps], "x:", label=f"{m} fwd")
    ax.axhline(1.0, color="k", lw=0.8)
    c = data["config"]
    ax.set(xlabel="P", ylabel="sharded time / single-rank time on T/P tokens",
           title=f"hla2, T/P={c['T_local']}, H={c['H']}, K=V={c['K']} (CPU, gloo)", xticks=Ps)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "sp_overhead.png", dpi=120)


if __name__ == "__main__":
    main()

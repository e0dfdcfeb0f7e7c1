"""Memory: peak RSS growth per rank of one hla2 fwd+bwd at fixed T/P as P grows.

Each configuration runs in a fresh world (peak RSS only ever grows), after a small
warm-up call; reported is the growth of the peak during the measured call. Beside
it, the single process on the whole T = P x T/P tokens.

    python benchmarks/bench_sp_memory.py        # -> runs/bench/sp_memory.{json,png}
    python benchmarks/bench_sp_memory.py --out benchmarks/results   # the committed figures
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sp_common import RESULTS, memory_task, save

from hla_sp.testing import World


def main(T_local: int = 16384, H: int = 2, K: int = 32, V: int = 32) -> None:
    data: dict = {"config": {"op": "hla2", "T_local": T_local, "H": H, "K": K, "V": V,
                             "dtype": "float32", "unit": "MiB of peak RSS growth"},
                  "sharded": {}, "single_on_T": {}}
    for P in (1, 2, 4, 8):
        with World(P) as w:
            per_rank = w.run(memory_task, T_local, H, K, V, True, timeout=1800)
        data["sharded"][str(P)] = [r["peak_mib"] - r["before_mib"] for r in per_rank]
        with World(1) as w:
            (one,) = w.run(memory_task, T_local * P, H, K, V, False, timeout=1800)
        data["single_on_T"][str(P)] = one["peak_mib"] - one["before_mib"]
        print(f"P={P}: per-rank peak growth {max(data['sharded'][str(P)]):.0f} MiB; "
              f"single process on T={T_local * P}: {data['single_on_T'][str(P)]:.0f} MiB",
              flush=True)
    path = save("sp_memory", data)
    print(f"wrote {path}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ps = sorted(int(p) for p in data["sharded"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(Ps, [max(data["sharded"][str(P)]) for P in Ps], "o-", label="sharded, max over ranks")
    ax.plot(Ps, [data["single_on_T"][str(P)] for P in Ps], "s--", label="one process on T")
    ax.set(xlabel="P", ylabel="peak RSS growth per rank (MiB)", xticks=Ps,
           title=f"hla2 fwd+bwd, T/P={T_local}, H={H}, K=V={K}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "sp_memory.png", dpi=120)


if __name__ == "__main__":
    main()

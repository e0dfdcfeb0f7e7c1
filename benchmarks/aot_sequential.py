"""Launch configurations of the opt-in sequential fused hla2 kernel, compiled ahead of
time for sm_90a and sm_80: the table its launcher refuses from.

``hla_sp.kernels.hla2_fused.SEQUENTIAL_MEASURED`` holds the spill per thread of each
configuration measured; ``hla2_fused(mode="sequential")`` refuses, before any work,
those over ``SPILL_LIMIT`` on either arch. This script recompiles the listed ones (or,
with ``--all``, every configuration ``hla2_fused`` can reach: 168, 336 compiles) with
the compile and cache of :mod:`aot`, prints the table as the literal to commit, says
whether the committed entries are current, and stores its rows under ``"sequential"``
in ``benchmarks/results/aot.json``. ``tests/unit/benchmarks/test_aot.py`` runs the same check.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from typing import Any

import aot


def sequential_configs(only: set[tuple] | None = None) -> list[dict[str, Any]]:
    """Every launch configuration of the sequential fused kernel that ``hla2_fused``
    can reach, refused ones included, each tagged with its key of
    ``hla_sp.kernels.hla2_fused.SEQUENTIAL_MEASURED`` (in ``used_by``).

    Axes: inputs (fp32 IEEE, TF32, bf16, fp16), BK (16-128; fp32 stops at 64, over
    the shared memory beyond), BV (16, 32), decay, documents, initial states (not with
    documents: refused by ``hla2_fused``). Captured through the launcher itself;
    ``only``: just these keys.
    """
    env = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from hla_sp.kernels import _jit
    from hla_sp.kernels.hla2_fused import MAX_FUSED_K_FP32, launch_sequential

    dtypes = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
              "fp16": torch.float16}
    out = []
    try:
        for name, K, V, decay, docs, states in itertools.product(
            dtypes, (16, 32, 64, 128), (16, 32), (False, True), (False, True), (False, True)
        ):
            if (docs and states) or (name in ("fp32", "tf32") and K > MAX_FUSED_K_FP32):
                continue
            if only is not None and (name, K, V, decay, docs, states) not in only:
                continue
            dt = dtypes[name]
            x = torch.zeros(1, 1, 1, K, dtype=dt)
            flags = dict(HAS_G=decay, HAS_R=docs, DOT_PREC="tf32" if name == "tf32" else "ieee",
                         UPCAST=False)
            with _jit.capture() as launched:
                launch_sequential(
                    x, x, torch.zeros(1, 1, 1, V, dtype=dt),
                    torch.zeros(1, 1, 1) if decay else None,
                    torch.zeros(1, 1, dtype=torch.int32) if docs else None,
                    torch.zeros(1, 1, K, K) if states else None,
                    torch.zeros(1, 1, K, V) if states else None,
                    0.0, torch.zeros(1, 1, 1, V), flags,
                )
            (job,) = launched
            aot._for_gpu(job)
            key = [name, job["constexprs"]["BK"], job["constexprs"]["BV"], decay, docs, states]
            out.append(dict(job, used_by=[json.dumps(key)], default=False))
    finally:
        if env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = env
    return out


def measure(only: set[tuple] | None = None, workers: int | None = None) -> tuple[dict, list]:
    """Compile :func:`sequential_configs` (``only`` these keys); returns the table
    (key -> {arch: spill bytes per thread}, in key order) and the compiled rows."""
    rows = aot.compile_all(sequential_configs(only), workers)
    table: dict[tuple, dict[str, int]] = {}
    for r in rows:
        if r.get("error"):
            raise RuntimeError(f"{r['used_by'][0]} {r['arch']}: {r['error']}")
        table.setdefault(tuple(json.loads(r["used_by"][0])), {})[r["arch"]] = aot.spill_bytes(r)
    return {k: dict(sorted(v.items())) for k, v in sorted(table.items())}, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--all", action="store_true", help="every configuration, not only the listed")
    ap.add_argument("--workers", type=int, default=None)
    args = ap.parse_args()
    from hla_sp.kernels.hla2_fused import SEQUENTIAL_MEASURED, SPILL_LIMIT

    table, rows = measure(None if args.all else set(SEQUENTIAL_MEASURED), args.workers)
    data = json.loads(aot.RESULTS.read_text()) if aot.RESULTS.exists() else {}
    data["sequential"] = rows
    aot.RESULTS.write_text(json.dumps(data, indent=1, sort_keys=True))
    print("SEQUENTIAL_MEASURED: dict[SequentialKey, dict[str, int]] = {")
    for key, spills in table.items():
        over = "  # refused" if max(spills.values()) > SPILL_LIMIT else ""
        print(f"    {key!r}: {spills!r},{over}")
    print("}")
    stale = [k for k, v in SEQUENTIAL_MEASURED.items() if table.get(k) != v]
    new = [k for k in table if k not in SEQUENTIAL_MEASURED]
    print(f"{len(rows)} compiles; {len(stale)} committed entries not current, {len(new)} new")
    return 1 if stale or new else 0


if __name__ == "__main__":
    sys.exit(main())

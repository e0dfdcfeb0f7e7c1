"""The operators' speed at several git revisions, interleaved: what a change cost or saved.

Each revision's ``hla_sp`` and ``kernels`` are extracted (``git archive``; ``WORKTREE``
copies the working tree) into a temporary directory, and a fresh process per
(round, revision) times the forward + backward of ``hla2`` and ``linear_attention``
there, fp32, B = 1, H = 4, K = V = 64, one thread, on the same random inputs. The
revisions take turns round after round, so a slow spell of the machine falls on all
of them; each call is timed in thread CPU time (the process's own work: a shared or
virtual machine's stolen time is left out), and the median and the minimum per
revision are reported with their ratios to the first revision.

    python benchmarks/bench_revisions.py 4805f70 HEAD WORKTREE --out benchmarks/results

Writes ``<name>.json`` under ``--out`` (default ``runs/bench``, name ``revisions``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPS = ("hla2", "linear_attention")

# Run inside each extracted tree: prints {op: [seconds per call]} as one JSON line.
_CHILD = r"""
import json, os, sys, time, torch
torch.set_num_threads(1)
import hla_sp.ops as ops
assert ops.__file__.startswith(os.getcwd()), ops.__file__  # the tree's own code
T, reps = int(sys.argv[1]), int(sys.argv[2])
g = torch.Generator().manual_seed(0)
q, k, v = [torch.randn(1, T, 4, 64, generator=g).requires_grad_() for _ in range(3)]
out = {}
for name in sys.argv[3:]:
    f = getattr(ops, name)
    def call():
        o = f(q, k, v)
        (o[0] if isinstance(o, tuple) else o).sum().backward()
    call()  # warm-up
    ts = []
    for _ in range(reps):
        t0 = time.thread_time()
        call()
        ts.append(time.thread_time() - t0)
    out[name] = ts
print(json.dumps(out))
"""


def extract(rev: str, into: Path) -> str:
    """``rev``'s hla_sp and kernels under ``into``; returns the commit (or WORKTREE)."""
    into.mkdir(parents=True)
    if rev == "WORKTREE":
        for d in ("hla_sp", "kernels"):
            shutil.copytree(ROOT / d, into / d, ignore=shutil.ignore_patterns("__pycache__"))
        return rev
    commit = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    archive = subprocess.run(["git", "archive", commit, "hla_sp", "kernels"], cwd=ROOT,
                             check=True, capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return commit


def time_tree(tree: Path, T: int, reps: int, ops: list[str]) -> dict[str, list[float]]:
    """One fresh process in ``tree``: seconds per call of each op."""
    # hla_sp.kernels is a folder beside hla_sp in the repository; an editable install
    # maps it from the checkout, so the tree's own copy is put in place as a package
    shutil.rmtree(tree / "hla_sp" / "kernels", ignore_errors=True)
    shutil.copytree(tree / "kernels", tree / "hla_sp" / "kernels")
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1",
           # freed memory kept in the heap, as bench_ops times it
           "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}  # fmt: skip
    p = subprocess.run([sys.executable, "-c", _CHILD, str(T), str(reps), *ops], cwd=tree,
                       env=env, capture_output=True, text=True, timeout=3600)  # fmt: skip
    if p.returncode:
        raise RuntimeError(f"{tree}: timing failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("revs", nargs="+", help="git revisions, or WORKTREE; the first is the base")
    ap.add_argument("--t", type=int, default=16384, help="sequence length")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5, help="timed calls per process")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench")
    ap.add_argument("--name", default="revisions")
    args = ap.parse_args(argv)
    ops = args.ops.split(",")
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for i, rev in enumerate(args.revs):
            tree = Path(tmp) / f"r{i}"
            trees[rev] = (extract(rev, tree), tree)
        times: dict[str, dict[str, list[float]]] = {r: {o: [] for o in ops} for r in args.revs}
        for rnd in range(args.rounds):
            for rev, (_, tree) in trees.items():
                for op, ts in time_tree(tree, args.t, args.reps, ops).items():
                    times[rev][op] += ts
                print(f"round {rnd + 1}/{args.rounds} {rev}: " + ", ".join(
                    f"{op} {statistics.median(times[rev][op]):.3f} s" for op in ops), flush=True)
    base = args.revs[0]
    summary = {}
    for rev, (commit, _) in trees.items():
        summary[rev] = {"commit": commit}
        for op in ops:
            med, low = statistics.median(times[rev][op]), min(times[rev][op])
            summary[rev][op] = {
                "median_s": med, "min_s": low,
                "median_ratio": med / statistics.median(times[base][op]),
                "min_ratio": low / min(times[base][op]),
            }  # fmt: skip
    result = {
        "what": "forward + backward, fp32, B=1, H=4, K=V=64, 1 thread, thread CPU time",
        "T": args.t, "rounds": args.rounds, "reps_per_round": args.reps, "base": base,
        "summary": summary, "times_s": times,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "wall_s": time.perf_counter() - t0,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps(result, indent=1))
    for rev, s in summary.items():
        print(f"{rev:>10} ({s['commit']}): " + "; ".join(
            f"{op} median {s[op]['median_s']:.3f} s (x{s[op]['median_ratio']:.2f}), "
            f"min {s[op]['min_s']:.3f} s (x{s[op]['min_ratio']:.2f})" for op in ops))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

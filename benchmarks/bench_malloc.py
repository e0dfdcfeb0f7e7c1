"""The workers' CPU allocator: ``make demo`` and ``make demo-python`` under each policy.

    python benchmarks/bench_malloc.py [--targets demo,demo-python] [--iters 40]
                                      [--policies glibc-default,mmap-128k,launcher]
                                      [--out runs/bench] [--name bench_malloc]

Each target's training command is read from the Makefile as written (paths moved to a
temporary directory, ``--train-iters`` set to ``--iters`` with the whole run's learning
rate schedule, ``--log-interval 1`` so that every step is timed) and run once per
policy:

* ``glibc-default``: glibc's own thresholds (dynamic mmap threshold, 128 KiB trim);
  ``GLIBC_TUNABLES=glibc.malloc.perturb=0`` (glibc's default value) marks the allocator
  as the user's, so the launcher adds nothing;
* ``mmap-128k``: ``MALLOC_MMAP_THRESHOLD_=131072``, the launcher's policy before
  ``hla_sp.launch.distributed.allocator``;
* ``launcher``: nothing set; the launcher's policy (both thresholds at 1 GiB).

Per run: wall time; user and system CPU seconds and minor page faults of the launcher
and every worker (``wait4`` on the launcher, which counts its waited-for workers); the
largest resident set of any of them; the trainer's peak memory at the first and the
last iteration (memory that creeps from step to step shows there); the median step
time after the first step; the last loss, and whether every loss equals the first
policy's bit for bit. The load
average before each run is recorded beside it: figures taken beside other work say so.
Writes ``OUT/NAME.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = {
    "glibc-default": {"GLIBC_TUNABLES": "glibc.malloc.perturb=0"},
    "mmap-128k": {"MALLOC_MMAP_THRESHOLD_": "131072"},
    "launcher": {},
}


def makefile_command(target: str, makefile: str = os.path.join(ROOT, "Makefile")) -> list[str]:
    """The ``hla_sp.launch.cli train`` command of ``target``'s recipe, as argv."""
    with open(makefile) as f:
        text = f.read().replace("\\\n", " ")
    m = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)+)", text, flags=re.M)
    if m is None:
        raise SystemExit(f"--targets: no target {target!r} in {makefile}")
    for line in m.group(1).splitlines():
        argv = shlex.split(line.strip())
        if argv[:4] == ["$(PY)", "-m", "hla_sp.launch.cli", "train"]:
            return [sys.executable, *argv[1:]]
    raise SystemExit(f"--targets: {target!r} runs no hla-sp train")


def run_command(argv: list[str], iters: int, tmp: str) -> list[str]:
    """``argv`` with its run directory moved under ``tmp``, ``iters`` steps, every step
    logged; the learning rate follows the whole run's schedule (its ``--train-iters`` as
    ``--lr-decay-iters``), so the steps are the first ``iters`` of the target's run."""
    out, skip = [], False
    whole = argv[argv.index("--train-iters") + 1]
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a in ("--train-iters", "--log-interval"):
            skip = True
            continue
        out.append(re.sub(r"^runs/", tmp + "/", a) if argv[i - 1].startswith("--") else a)
    decay = [] if "--lr-decay-iters" in argv else ["--lr-decay-iters", whole]
    return [*out, "--train-iters", str(iters), "--log-interval", "1", *decay]


def measure(argv: list[str], policy: dict[str, str], jsonl: str) -> dict[str, Any]:
    """One run under ``policy``: times, faults, resident set, step times and losses."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    env.update(policy)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read() if proc.stdout else ""
    # the launcher's and its waited-for workers' usage, this run only
    _, status, use = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(argv)} failed:\n{output[-4000:]}")
    with open(jsonl) as f:
        rows = [r for r in map(json.loads, filter(str.strip, f)) if "loss" in r]
    steps = [r["step_time_s"] for r in rows[1:]]
    return {
        "load_avg_1min_before": round(load, 2),
        "wall_s": round(wall, 2),
        "user_s": round(use.ru_utime, 2),
        "sys_s": round(use.ru_stime, 2),
        "minor_faults": use.ru_minflt,
        "max_rss_gib_any_process": round(use.ru_maxrss / 2**20, 3),  # Linux: KiB
        # the trainer's peak per iteration (max of ranks): memory that creeps shows here
        "peak_mem_gib_first_last": [round(rows[i]["peak_mem_bytes"] / 2**30, 3)
                                    for i in (0, -1)],
        "step_s_median": round(statistics.median(steps), 4) if steps else None,
        "iterations": len(rows),
        "loss_last": rows[-1]["loss"],
        "losses": [r["loss"] for r in rows],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="demo,demo-python")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench"))
    p.add_argument("--name", default="bench_malloc")
    args = p.parse_args(argv)
    if args.iters < 2:
        p.error(f"--iters: expected >= 2 (the first step is not timed), got {args.iters}")
    policies = args.policies.split(",")
    bad = [q for q in policies if q not in POLICIES]
    if bad:
        p.error(f"--policies: expected names among {', '.join(POLICIES)}, got {bad}")
    result: dict[str, Any] = {
        "command": shlex.join(["python", "benchmarks/bench_malloc.py",
                               *(sys.argv[1:] if argv is None else argv)]),
        "cpus": os.cpu_count(), "platform": platform.platform(),
        "glibc": platform.libc_ver()[1], "iters": args.iters, "runs": {}}
    for target in args.targets.split(","):
        base = makefile_command(target)
        for name in policies:
            with tempfile.TemporaryDirectory(prefix="bench-malloc-") as tmp:
                cmd = run_command(base, args.iters, tmp)
                jsonl = cmd[cmd.index("--log-jsonl") + 1]
                r = measure(cmd, POLICIES[name], jsonl)
            first = result["runs"].get(f"{target}/{policies[0]}")
            r["losses_equal_to_first_policy"] = first is None or r["losses"] == first["losses"]
            result["runs"][f"{target}/{name}"] = r
            print(f"{target:12s} {name:14s} wall {r['wall_s']:7.1f} s  user {r['user_s']:7.1f} s"
                  f"  sys {r['sys_s']:6.1f} s  minor faults {r['minor_faults'] / 1e6:6.2f} M  "
                  f"step {r['step_s_median']} s  loss {r['loss_last']:.4f}"
                  f"{'' if r['losses_equal_to_first_policy'] else '  LOSSES DIFFER'}"
                  f"  (load {r['load_avg_1min_before']})", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return 0 if all(r["losses_equal_to_first_policy"] for r in result["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Run ``make demo``'s command from scratch and write its summary: what the docs quote.

The command is read from the Makefile's ``demo`` recipe (so the summary is of the demo
as it stands), with ``$(PY)`` this interpreter and ``runs/demo`` a fresh directory.
tests/unit/benchmarks/test_docs_numbers.py checks every number the README and docs quote for
``make demo`` against the summary, and the summary's command against the Makefile.

    python benchmarks/record_demo.py            # -> runs/bench/demo.json
    python benchmarks/record_demo.py --out benchmarks/results   # the committed summary
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUIET_LOAD = 0.5  # 1-minute load average under which the machine counts as quiet


def makefile_recipe(target: str, makefile: Path = ROOT / "Makefile") -> str:
    """The shell command of ``target``'s recipe, continuation lines joined, as written."""
    lines = makefile.read_text().splitlines()
    head = re.compile(rf"^{re.escape(target)}\s*:(?!=)")
    start = next((i for i, line in enumerate(lines) if head.match(line)), None)
    if start is None:
        raise ValueError(f"target: expected a rule for {target!r} in {makefile}, found none")
    cmd: list[str] = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        cmd.append(line.strip().removesuffix("\\").strip())
        if not line.rstrip().endswith("\\"):
            break
    return " ".join(cmd)


def read_records(path: Path) -> list[dict]:
    """The iteration records of a metrics JSONL (start markers dropped)."""
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "event" not in rec:
            out.append(rec)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench", help="Directory of demo.json.")
    ap.add_argument("--workdir", default="runs/record-demo",
                    help="Replaces runs/demo in the command; emptied first.")
    args = ap.parse_args(argv)
    recipe = makefile_recipe("demo")
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    cmd = shlex.split(recipe.replace("$(PY)", sys.executable).replace("runs/demo", str(work)))
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True)
    wall = time.perf_counter() - t0
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = used.ru_utime + used.ru_stime
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    if proc.returncode:
        print(f"record_demo: the demo failed (exit {proc.returncode})", file=sys.stderr)
        return proc.returncode
    recs = read_records(ROOT / work / "metrics.jsonl")
    gib = [r["peak_mem_bytes"] / 2**30 for r in recs]
    summary = {
        "target": "make demo",
        "command": recipe,
        "wall_s": wall,
        "wall_min": wall / 60,
        # CPU seconds of every process of the run: what a loaded machine inflates least
        "cpu_s": cpu,
        "iterations": recs[-1]["iteration"],
        "losses": [r["loss"] for r in recs],
        "loss_first": recs[0]["loss"],
        "loss_last": recs[-1]["loss"],
        "tokens_per_s": [r["tokens_per_s"] for r in recs],
        "step_time_s": [r["step_time_s"] for r in recs],
        "peak_mem_gib": gib,
        "peak_mem_gib_max": max(gib),
        "world_size": recs[-1]["world_size"],
        "cp": recs[-1]["cp"],
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg(),
                    "niceness": os.nice(0),
                    # timings of a loaded machine are not what the docs may quote
                    "quiet": load_before[0] < QUIET_LOAD},
        "stdout": proc.stdout.splitlines()[-8:],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"record_demo: {wall:.0f} s, loss {recs[0]['loss']:.4f} -> {recs[-1]['loss']:.4f}; "
          f"wrote {out / 'demo.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

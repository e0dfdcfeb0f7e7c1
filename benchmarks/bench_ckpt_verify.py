"""What the checkpoint's file digests cost: SHA-256 on save, verification on load.

For each model size a plain module of fp32 ``Linear`` layers with AdamW's two moments
is saved by :func:`hla_sp.launch.checkpoint.save` (one gloo rank) and loaded back by
:func:`hla_sp.launch.checkpoint.load`, with the manifest's verification and without it
(the same load with ``manifest.verify`` replaced by a no-op), and the verification alone,
interleaved, ``--repeats`` times each; the minimum of each is reported (the run least
disturbed by other work on a shared machine; the medians are in the JSON too), and the
cost is the verification's time over the unverified load's. Two cache states:

* ``warm``: the files are in the page cache (just written or read): the verification's
  cost is pure hashing;
* ``cold``: before each load the checkpoint's own files are dropped from the page cache
  (``posix_fadvise(DONTNEED)`` on each file, nothing else is touched): the verification
  reads them from the disk and the load then finds them cached.

It also times the save with and without the digests (``digest_files`` replaced by an
empty list). ``--algorithms``: SHA-256 (what the
manifest uses) and zlib's CRC-32, the fastest digest in the standard library.

    python benchmarks/bench_ckpt_verify.py                   # -> runs/bench/ckpt_verify.json
    python benchmarks/bench_ckpt_verify.py --out benchmarks/results   # the committed figures
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hla_sp.launch import checkpoint
from hla_sp.launch.checkpoint import manifest, store

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[32, 128],
                    help="fp32 parameter MiB per model (the checkpoint is about 3x: "
                         "weights and two moments)")
    ap.add_argument("--repeats", type=int, default=5, help="loads per variant and cache state")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench",
                    help="directory for ckpt_verify.json (default runs/bench)")
    ap.add_argument("--algorithms", nargs="+", default=["sha256", "crc32"],
                    help="digests to compare (the manifest records which one wrote it)")
    ap.add_argument("--tmp", default=None, help="where to write the checkpoints (a real disk)")
    return ap.parse_args(argv)


def _parts(mib: int) -> dict[str, Any]:
    width = 1024
    layers = max(1, mib * 2**20 // (4 * width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(layers)])  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # one step, so that the moments exist
        p.grad = torch.randn_like(p)
    opt.step()
    return {"model": model, "optimizer": opt,
            "scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _drop_cache(d: str) -> None:
    """Evict this checkpoint's files (only them) from the page cache."""
    for base, _, files in os.walk(d):
        for f in files:
            fd = os.open(os.path.join(base, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(mib: int, repeats: int, tmp: str) -> dict[str, Any]:
    root = os.path.join(tmp, f"ck{mib}")
    parts = _parts(mib)
    kw = dict(rank=0, world_size=1, tp_rank=0, writes_model=True, consumed_samples=0,
              config={}, **parts)  # fmt: skip
    save_with, save_without = [], []
    for i in range(max(2, repeats // 2)):
        save_with.append(_timed(lambda i=i: checkpoint.save(root, 2 * i + 1, **kw)))
        with _patched(manifest, "digest_files", lambda d, names: {}), \
                _patched(manifest, "write", lambda *a, **k: None):
            save_without.append(_timed(lambda i=i: checkpoint.save(root, 2 * i + 2, **kw)))
    it = 1
    d = checkpoint.iter_dir(root, it)
    body = manifest.read(d)
    assert body is not None
    nbytes = manifest.files_bytes(body)
    load_kw = dict(rank=0, world_size=1, tp_rank=0, step=it, **_parts(mib))

    def load() -> None:
        checkpoint.load(root, **load_kw)

    def unverified() -> None:
        with _patched(store.manifest, "verify", lambda d, it: None):
            checkpoint.load(root, **load_kw)

    def verify() -> None:
        manifest.verify(d, it)

    out: dict[str, Any] = {"param_mib": mib, "checkpoint_bytes": nbytes,
                           "files": len(body["files"])}  # fmt: skip
    load()  # warm-up (imports, allocator)
    for cache in ("warm", "cold"):
        times: dict[str, list[float]] = {"verified": [], "unverified": [], "verify": []}
        for _ in range(repeats):  # interleaved: a burst of load from elsewhere hits all
            for name, fn in (("unverified", unverified), ("verify", verify),
                             ("verified", load)):
                if cache == "cold":
                    _drop_cache(d)
                times[name].append(_timed(fn))
        # the minimum is the run least disturbed by other work on a shared machine
        best = {k: min(v) for k, v in times.items()}
        out[cache] = {"load_verified_s": best["verified"],
                      "load_unverified_s": best["unverified"],
                      "verify_s": best["verify"],
                      "overhead": best["verify"] / best["unverified"],
                      "overhead_paired": best["verified"] / best["unverified"] - 1,
                      "median": {k: statistics.median(v) for k, v in times.items()},
                      "samples": times}  # fmt: skip
    out["digest_gib_per_s"] = nbytes / 2**30 / out["warm"]["verify_s"]
    sw, so = min(save_with), min(save_without)
    out["save"] = {"with_digests_s": sw, "without_s": so, "overhead": (sw - so) / so,
                   "samples_with": save_with, "samples_without": save_without}
    return out


def _line(p: dict[str, Any]) -> str:
    w, c, sv = p["warm"], p["cold"], p["save"]
    return (f"{p['algorithm']}: {p['param_mib']} MiB of parameters, "
            f"{p['checkpoint_bytes'] / 2**20:.0f} MiB checkpoint: load warm "
            f"{w['load_unverified_s']:.3f} s + verify {w['verify_s']:.3f} s "
            f"({w['overhead']:+.0%}); cold {c['load_unverified_s']:.3f} s + "
            f"{c['verify_s']:.3f} s ({c['overhead']:+.0%}); save {sv['without_s']:.3f} s + "
            f"digests {sv['with_digests_s'] - sv['without_s']:.3f} s; digest "
            f"{p['digest_gib_per_s']:.2f} GiB/s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="bench_ckpt_verify_") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=0,
                                world_size=1)  # fmt: skip
        try:
            points = []
            for mib in args.sizes_mib:
                for alg in args.algorithms:
                    with _patched(manifest, "ALGORITHM", alg):
                        p = measure(mib, args.repeats, os.path.join(tmp, alg))
                    p["algorithm"] = alg
                    points.append(p)
                    print(_line(p), flush=True)
        finally:
            dist.destroy_process_group()
    result = {"benchmark": "ckpt_verify", "time_utc": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                      time.gmtime()),
              "machine": platform.machine(), "cpus": os.cpu_count(),
              "load_avg_1m": os.getloadavg()[0], "python": sys.version.split()[0],
              "torch": torch.__version__, "points": points}  # fmt: skip
    path = args.out / "ckpt_verify.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

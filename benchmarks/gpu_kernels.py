"""Per-kernel time against fla's, launches counted, and no host sync on the call path.

One forward + backward of each method (``gpu_common.methods``: ours ``la``, ``la_g``,
``kernels_g``, ``hla2``; fla's ``fla_gamma``, ``fla_g``) after warm-up, under
torch.profiler; its GPU kernels grouped by name, then by role (:data:`ROLES`: fla's
``chunk_fwd_h``, ``chunk_bwd_dh``, ``chunk_fwd_o``, ``chunk_bwd_dv``,
``chunk_bwd_dqkwg`` and ours beside them). Kernel names are matched by the patterns
of :data:`ROLES` only, so renamed kernels need one line changed there; a kernel no
pattern claims is listed under ``other`` with its own name.

Launches: every GPU kernel of the step (the profiler), and our Triton launches by name
(``hla_sp.kernels._jit.LAUNCHES``); the issue's bound is 15 for ``la`` without
documents. Host syncs: ``torch.cuda.set_sync_debug_mode("error")`` around one warm
call of ``la`` and of ``hla2``; a sync is recorded as a failure with its message.

    python benchmarks/gpu_kernels.py --out runs/gpu_lease/kernels.json      (one GPU)
    python benchmarks/gpu_kernels.py --dry-run --out /tmp/kernels.json      (CPU)

The dry run has no GPU kernels to time: it counts our launches and checks the plumbing.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import gpu_common as gc  # first: --dry-run sets TRITON_INTERPRET before torch loads
import torch

# role -> regular expression over kernel names (case-insensitive search); the first
# role that matches claims a kernel. fla 0.6's names: chunk_fwd_kernel_h,
# chunk_bwd_kernel_dh, chunk_fwd_kernel_o, chunk_bwd_kernel_dv(_local),
# chunk_bwd_kernel_dqkwg, chunk_local_cumsum_scalar_kernel. Ours before the rewrite:
# chunk_state_kernel + state_passing_kernel (fwd_h), chunk_fwd_o_kernel,
# chunk_bwd_dv_kernel, chunk_bwd_dqk_kernel, reverse_cumsum_kernel.
ROLES: tuple[tuple[str, str], ...] = (
    ("poison", r"poison"),  # ours: the gated isolation launches (one word read when finite)
    ("bwd_dh", r"bwd\w*_dh|dh\w*bwd|state\w*(rev|bwd)|(rev|bwd)\w*state"),
    ("bwd_dv", r"bwd\w*_dv|dv\w*bwd"),
    ("bwd_dqk", r"bwd\w*_dq|dqk"),
    ("fwd_o", r"fwd\w*_o(_|\b)|chunk_o\b|output\w*kernel"),
    ("fwd_h", r"fwd\w*_h(_|\b)|chunk_state|state_passing|states?_kernel"),
    ("cumsum", r"cumsum"),
)
LAUNCH_BOUND = 15  # GPU kernels of one linear_attention forward + backward (issue item 4)
PROFILED = ("la", "la_g", "kernels_g", "hla2", "fla_gamma", "fla_g")
DRY_PROFILED = ("la", "kernels_g")  # the interpreter is slow; these reach every code path


def role(name: str) -> str:
    """The role of a kernel by its name (:data:`ROLES`), or "other"."""
    for r, pattern in ROLES:
        if re.search(pattern, name, re.IGNORECASE):
            return r
    return "other"


def our_launches() -> Counter[str]:
    from hla_sp.kernels import _jit

    return Counter(_jit.LAUNCHES)


def profile_step(fn: gc.Step, device: str) -> dict[str, Any]:
    """One warm step under the profiler: GPU kernels by name (calls, ms), their total,
    and our Triton launches by name."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2 if device == "cuda" else 1):  # compile, autotune, allocator growth
        fn()
    gc.sync(device)
    before = our_launches()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        gc.sync(device)
    ours = our_launches() - before
    kernels: dict[str, dict[str, Any]] = defaultdict(lambda: dict(calls=0, ms=0.0))
    for e in prof.events():
        if device == "cuda" and e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[e.name]
            k["calls"] += 1
            k["ms"] += e.time_range.elapsed_us() / 1e3
    if device != "cuda":  # no GPU kernels: our launches by name, untimed
        for name, n in ours.items():
            kernels[name] = dict(calls=n, ms=None)
    timed = device == "cuda"
    return dict(kernels=dict(kernels), triton_launches=dict(ours),
                gpu_launches=sum(int(k["calls"]) for k in kernels.values()) if timed else None,
                ms_total=sum(k["ms"] for k in kernels.values()) if timed else None)


def by_role(kernels: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Kernels summed by role (ms None when untimed: the dry run)."""
    out: dict[str, dict[str, Any]] = {}
    for name, k in kernels.items():
        r = out.setdefault(role(name), dict(calls=0, ms=0.0, names=[]))
        r["calls"] += k["calls"]
        r["ms"] = None if k["ms"] is None or r["ms"] is None else r["ms"] + k["ms"]
        r["names"].append(name[:80])
    return out


def sync_check(fn: gc.Step, device: str) -> dict[str, Any]:
    """One warm call under set_sync_debug_mode("error"): ok, or the sync's message."""
    if device != "cuda":
        return dict(ok=None, note="no CUDA: the sync check needs a GPU")
    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        res: dict[str, Any] = dict(ok=True)
    except RuntimeError as e:  # the sync itself: a failure to report, not to crash on
        res = dict(ok=False, error=str(e).splitlines()[0][:300])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return res


def table(result: dict[str, Any], shape: str) -> list[dict[str, Any]]:
    """Rows of role: ours against fla (fla_g), the same per-token decay; ours is la_g,
    or the kernels alone where la_g has no profile."""
    prof = result["profiles"].get(shape, {})
    mine = next((m for m in ("la_g", "kernels_g") if "roles" in prof.get(m, {})), None)
    ours = prof[mine]["roles"] if mine else {}
    peer = prof.get("fla_g", {}).get("roles", {})
    rows = []
    for r in [x for x, _ in ROLES] + ["other"]:
        a, b = ours.get(r), peer.get(r)
        if a is None and b is None:
            continue
        rows.append(dict(role=r, ours=mine, ours_ms=a and a["ms"], ours_calls=a and a["calls"],
                         ours_names=a and a["names"], fla_ms=b and b["ms"],
                         fla_calls=b and b["calls"], fla_names=b and b["names"],
                         ratio=(a["ms"] / b["ms"]) if a and b and a["ms"] and b["ms"]
                         else None))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU interpreter")
    p.add_argument("--out", type=Path, default=Path("runs/gpu_lease/kernels.json"))
    p.add_argument("--T", type=int, default=32768, help="sequence length (GPU)")
    a = p.parse_args()
    device, dtype = gc.setup(a.dry_run)
    s = gc.DRY_SHAPES[0] if a.dry_run else gc.Shape(1, a.T, 16, 128)
    result: dict[str, Any] = gc.header(device, a.dry_run) | dict(profiles={}, sync={})
    x = gc.inputs(s, device, dtype)
    steps, missing = gc.methods(x, device)
    prof = result["profiles"][s.label] = {m: dict(missing=w) for m, w in missing.items()}
    for name in DRY_PROFILED if a.dry_run else PROFILED:
        if name not in steps:
            continue
        try:
            r = profile_step(steps[name], device)
            r["roles"] = by_role(r["kernels"])
        except Exception as e:  # one method's failure costs only its own figures
            r = dict(error=f"{type(e).__name__}: {e}"[:300])
        prof[name] = r
        print(f"[kernels] {name:10s} " + (r.get("error") or
              f"{r['ms_total']} ms of kernels, {r['gpu_launches']} GPU launches, "
              f"ours {sum(r['triton_launches'].values())}: {dict(r['triton_launches'])}"),
              flush=True)
        gc.write(a.out, result)
    for name in ("la", "hla2"):
        try:
            result["sync"][name] = sync_check(steps[name], device)
        except Exception as e:
            result["sync"][name] = dict(ok=False, error=f"{type(e).__name__}: {e}"[:300])
        print(f"[sync] {name}: {result['sync'][name]}", flush=True)
    la = prof.get("la", {})
    n = la.get("gpu_launches")
    result["launch_target"] = dict(method="la", bound=LAUNCH_BOUND, launches=n,
                                   ok=None if n is None else n <= LAUNCH_BOUND)
    result["table"] = table(result, s.label)
    # the tiles each of our kernels settled on (timed at its first call for a shape)
    from hla_sp.kernels._tiles import chosen

    result["tuned"] = chosen()
    for row in result["tuned"]:
        print(f"[tuned] {row['role']:5s} {row['dtype']} K {row['K']} V {row['V']} "
              f"sm_{row['arch']}: {row['BK']} x {row['BV']}, {row['num_warps']} warps "
              f"({row['key']})")
    for r in result["table"]:
        print(f"[role] {r['role']:8s} ours {r['ours_ms']} ms ({r['ours_calls']}x) "
              f"fla {r['fla_ms']} ms ({r['fla_calls']}x)")
    gc.write(a.out, result)
    return 0 if "error" not in la else 1


if __name__ == "__main__":
    sys.exit(main())

"""The way from ``HLAttention.forward`` to the first chunk kernel, traced call by call.

Runs one layer call on one process (packed documents given as ``cu_seqlens``, the
torch chunk path) under ``sys.setprofile`` and records, up to the first call into the
chunk scan (:mod:`hla_sp.ops.chunk.scan`), every Python call and return inside the
package: the files entered, how many stays (a run of calls in one file), how many
returns, and the calls into ``hla_sp/ops/validate.py``. This is the measure of the
house's "files per layer call" (docs/operators.md); it writes JSON.

    HLA_SP_BACKEND=torch python benchmarks/trace_layer_call.py \
        [--out benchmarks/results/layer_call_trace.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
FIRST_KERNEL = ("hla_sp/ops/chunk/scan.py",)


def _rel(path: str) -> str | None:
    """The file's path inside the repository, or None outside the package."""
    try:
        rel = Path(path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return None
    return rel if rel.split("/")[0] in ("hla_sp", "kernels") else None


def trace(planned: bool = False) -> dict[str, Any]:
    """Trace one call (the documents as ``cu_seqlens``, or with ``planned`` as the
    batch's plan built beforehand, as a trainer does once per batch); returns the
    figures and the files in the order entered."""
    from hla_sp.nn import HLAttention
    from hla_sp.ops.sharding import plan_documents

    torch.manual_seed(0)
    layer = HLAttention(32, 4, operator="hla2")
    x = torch.randn(1, 64, 32)
    cu = torch.tensor([0, 20, 41, 64])
    docs = {"plan": plan_documents(cu, 64)} if planned else {"cu_seqlens": cu}
    layer(x, **docs)  # warm: first-call checks and imports are not the path

    files: list[str] = []
    events: list[tuple[str, str, str]] = []
    stop = {"hit": False}

    def prof(frame: Any, event: str, arg: Any) -> None:
        if stop["hit"] or event not in ("call", "return"):
            return
        rel = _rel(frame.f_code.co_filename)
        if rel is None:
            return
        if event == "call" and rel in FIRST_KERNEL:
            stop["hit"] = True
            return
        events.append((event, rel, frame.f_code.co_name))
        if rel not in files:
            files.append(rel)

    sys.setprofile(prof)
    try:
        layer(x, **docs)
    finally:
        sys.setprofile(None)
    stays, last = 0, None
    for ev, rel, _ in events:
        if ev == "call" and rel != last:
            stays += 1
        last = rel if ev == "call" else last
    returns = sum(1 for i in range(1, len(events))
                  if events[i][0] == "return" and events[i][1] != events[i - 1][1])
    validate_calls = sum(1 for ev, rel, _ in events
                         if ev == "call" and rel == "hla_sp/ops/validate.py")
    return {"documents": "plan" if planned else "cu_seqlens",
            "files": len(files), "stays": stays, "returns_between_files": returns,
            "validate_calls": validate_calls, "reached_kernel": stop["hit"],
            "order": files}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    a = ap.parse_args(argv)
    results = [trace(planned=False), trace(planned=True)]
    for res in results:
        for k, v in res.items():
            if k != "order":
                print(f"{k}: {v}")
        for i, f in enumerate(res["order"], 1):
            print(f"  {i:2d}. {f}")
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

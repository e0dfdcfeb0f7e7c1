"""Ahead-of-time gate: every kernel configuration the public API launches, compiled for
H100/H200 (sm_90a) and A100 (sm_80) without a GPU.

1. **Capture.** Under Triton's interpreter with ``hla_sp.kernels._jit.capture`` the
   public operators run (forward and backward) over the matrix of :func:`cases`;
   launches are described (signature, constexprs, warps, stages), not run.
2. **Compile.** Each distinct configuration is compiled with
   ``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget(...))`` in a
   fresh process without the interpreter (its stdlib must be the GPU build), in
   parallel; the wheel's ``ptxas -v`` gives registers and spill bytes, the compiled
   metadata the shared memory. Results are cached under ``.aot-cache/`` (gitignored)
   by a hash of the kernels' source, the triton version, the configuration and arch.
3. **Gate.** :func:`failures` lists compile errors, shared memory over the arch's
   limit, kernels never launched, and spills over 1 KiB per thread in any
   configuration (``hla_sp.kernels._tiles.SPILL_LIMIT``). A tuning candidate for some
   archs only (wider tiles that sm_80 spills, tuned on sm_90 alone) is compiled and
   gated for those. The full capture (``make
   gpu-aot``) describes every tuning candidate of the primitive's kernels
   (``capture(every=True)``), so every configuration a GPU may choose is compiled; the
   test suite's share compiles the candidates the interpreter launches;
   ``benchmarks/aot_sequential.py`` measures the opt-in sequential fused hla2 for the
   table its launcher refuses from.

``UPCAST`` (the interpreter's bf16 emulation) is forced off. ``make gpu-aot`` writes
``benchmarks/results/aot.json`` and the table in ``docs/benchmarks.md``;
``tests/unit/benchmarks/test_aot.py`` runs the same gate.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import itertools
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".aot-cache"
RESULTS = ROOT / "benchmarks" / "results" / "aot.json"
DOC = ROOT / "docs" / "benchmarks.md"
ARCHS = {"sm_90a": 90, "sm_80": 80}
SHARED_LIMIT = {"sm_90a": 232_448, "sm_80": 166_912}  # opt-in max per block, bytes
# what a compile depends on besides the job itself (launchers only choose the jobs)
KERNEL_FILES = ("_decay.py", "_flags.py", "_jit.py", "_round.py", "chunk_fwd_kernels.py",
                "chunk_bwd_kernels.py", "chunk_h_kernels.py", "hla2_fused_kernels.py",
                "poison_kernels.py")
TABLE_BEGIN = "<!-- aot-table:begin (make gpu-aot writes this table) -->"
TABLE_END = "<!-- aot-table:end -->"

Case = dict[str, Any]


# --------------------------------------------------------------------------- capture


def cases(full: bool = True) -> list[Case]:
    """The public calls to capture.

    Axes: operator (linear_attention, hla2, ahla, hla3, hla2_fused chunked and
    sequential), dtype (fp32 IEEE, fp32 TF32, bf16, fp16), chunk size (16, 32, 64: the
    layer's powers of two; tiles clamp to [16, 64]), K = V (32, 128) and the input
    variants (no decay; per-token decay; per-head decay; per-token decay with varlen
    documents and initial/final states; decode: T = 1 with states; gqa: per-token
    decay and varlen documents with 2 query heads over 1 kv head, for the operators of
    the table); the sequential calls its launcher refuses launch nothing.
    ``full=False`` (the test suite's share) keeps the default chunk (64), both widths
    and two variants: per-token decay, and every flag on (decay, documents, states).
    """
    ops = ["linear_attention", "hla2", "ahla", "hla3", "hla2_fused:chunked",
           "hla2_fused:sequential"]
    dtypes = ["fp32", "tf32", "bf16", "fp16"]
    chunks = [16, 32, 64] if full else [64]
    dims = [32, 128]
    variants = ["plain", "token", "head", "varlen_states", "decode", "gqa"]
    if not full:
        variants = ["token", "varlen_states"]
    out = []
    for op, dt, chunk, d, var in itertools.product(ops, dtypes, chunks, dims, variants):
        if var == "decode" and chunk != 64:
            continue  # T = 1 caps every chunk size at the same tile
        if var == "gqa" and op.startswith("hla2_fused"):
            continue  # the fused hla2 takes one kv head per query head
        out.append(dict(op=op, dtype=dt, chunk=chunk, dim=d, variant=var))
    return out


def _call(case: Case) -> None:
    """Run one public call forward and backward (under capture: nothing computes)."""
    import torch
    from hla_sp.kernels.hla2_fused import sequential_refusal as refusal

    import hla_sp
    from hla_sp.ops import hla2_fused

    dt = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
          "fp16": torch.float16}[case["dtype"]]
    torch.set_float32_matmul_precision("high" if case["dtype"] == "tf32" else "highest")
    var, d, chunk = case["variant"], case["dim"], case["chunk"]
    T = 1 if var == "decode" else 2 * chunk + 3
    B, H = 1, 2

    def leaf(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape) * 0.1).to(dt).requires_grad_()

    hkv = 1 if var == "gqa" else H  # gqa: the group of both query heads reads one kv head
    q, k, v = leaf(B, T, H, d), leaf(B, T, hkv, d), leaf(B, T, hkv, d)
    kw: dict[str, Any] = dict(chunk_size=chunk)
    if var in ("token", "varlen_states", "decode", "gqa"):
        kw["log_decay"] = (-0.1 * torch.rand(B, T, hkv)).requires_grad_()
    elif var == "head":
        kw["log_decay"] = (-0.1 * torch.rand(H)).requires_grad_()
    if var in ("varlen_states", "gqa"):
        kw["cu_seqlens"] = torch.tensor([0, T // 2, T])
    op, _, mode = case["op"].partition(":")
    if mode == "sequential" and refusal(dt, d, d, var != "plain", var == "varlen_states",
                                        var == "decode"):
        return  # refused before any launch (K, shared memory, or spills over the limit)
    # hla2_fused refuses states with cu_seqlens: its varlen case runs without them
    states = var == "decode" or (var == "varlen_states" and op != "hla2_fused")
    n_docs = 2 if var == "varlen_states" else B
    if states:
        kw["output_final_state"] = True
        sym = torch.randn(n_docs, H, d, d) * 0.01
        sym = sym + sym.transpose(-1, -2)
        hv = torch.randn(n_docs, H, d, d) * 0.01
        if op == "linear_attention":
            kw["initial_state"] = hv.requires_grad_()
        elif op in ("hla2", "hla2_fused"):
            kw["initial_state"] = hla_sp.HLA2State(sym.requires_grad_(), hv.requires_grad_())
        elif op == "ahla":
            kw["initial_state"] = hla_sp.AHLAState(hv.clone().requires_grad_(),
                                                   hv.clone().requires_grad_())
        else:
            kw["output_final_state"] = False  # hla3's state tuple: forward only below
    fn = {"linear_attention": hla_sp.linear_attention, "hla2": hla_sp.hla2,
          "ahla": hla_sp.ahla, "hla3": hla_sp.hla3, "hla2_fused": hla2_fused}[op]
    if mode:
        kw["mode"] = mode
    o, _ = fn(q, k, v, **kw)
    o.float().sum().backward()


def capture(full: bool = True) -> tuple[list[dict[str, Any]], list[str]]:
    """Distinct launch configurations of :func:`cases` (each with the cases that
    launched it), and the names of every kernel defined."""
    env = {n: os.environ.get(n) for n in ("TRITON_INTERPRET", "HLA_SP_BACKEND")}
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["HLA_SP_BACKEND"] = "triton"
    import torch
    from hla_sp.kernels import _jit

    torch.manual_seed(0)
    configs: dict[str, dict[str, Any]] = {}
    before = torch.get_float32_matmul_precision()
    try:
        for case in cases(full):
            # make gpu-aot (full): every tuning candidate a GPU may choose; the test
            # suite's share: the configurations the interpreter launches (the first
            # candidate of each), which keeps a cold-cache suite minutes shorter
            with _jit.capture(every=full) as launched:
                _call(case)
            for job in launched:
                _for_gpu(job)
                key = json.dumps({k: job[k] for k in sorted(job)}, sort_keys=True)
                entry = configs.setdefault(key, dict(job, used_by=[]))
                tag = f"{case['op']}/{case['dtype']}/c{case['chunk']}/d{case['dim']}/" \
                      f"{case['variant']}"
                if len(entry["used_by"]) < 3:
                    entry["used_by"].append(tag)
                entry["default"] = entry.get("default", False) or _default_path(case)
    finally:
        torch.set_float32_matmul_precision(before)
        for n, val in env.items():  # the caller's (a test session's) settings
            if val is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = val
    return list(configs.values()), sorted(_jit.KERNELS)


def _for_gpu(job: dict[str, Any]) -> None:
    """In place: ``UPCAST`` (the interpreter's bf16 emulation) off, as on a GPU."""
    if "UPCAST" in job["constexprs"]:
        job["constexprs"]["UPCAST"] = False


def spill_bytes(row: dict[str, Any]) -> int:
    """A row's spill per thread: the larger of ptxas's spill stores and spill loads."""
    return max(row["spill_stores"], row["spill_loads"])


def _default_path(case: Case) -> bool:
    """Whether a case is a default path: any operator but the opt-in sequential fused
    hla2, whose one-program-per-head form is a measured option, not a default."""
    return case["op"] != "hla2_fused:sequential"


# --------------------------------------------------------------------------- compile


def _source_hash() -> str:
    import triton

    h = hashlib.sha256(triton.__version__.encode())
    for name in KERNEL_FILES:
        h.update((ROOT / "kernels" / name).read_bytes())
    return h.hexdigest()[:16]


def _ptxas(arch: str) -> list[str]:
    """The ptxas Triton itself runs for ``arch``, with Triton's own options."""
    from triton.backends.nvidia.compiler import get_ptxas

    return [get_ptxas(ARCHS[arch]).path, "-lineinfo", "-v", "--regAllocOptLevel=2"]


def _compile_one(job: dict[str, Any], arch: str, src_hash: str) -> dict[str, Any]:
    """Compile one configuration for one arch (in a worker without the interpreter)."""
    key = hashlib.sha256(
        json.dumps([src_hash, arch, {k: job[k] for k in sorted(job) if k not in
                                     ("used_by", "default")}], sort_keys=True).encode()
    ).hexdigest()[:24]
    cached = CACHE / "results" / f"{key}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_CACHE_DIR", str(CACHE / "triton"))
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out: dict[str, Any] = {"arch": arch, "job": _describe(job)}
    try:
        import hla_sp.kernels.chunk_bwd_kernels
        import hla_sp.kernels.chunk_fwd_kernels
        import hla_sp.kernels.chunk_h_kernels
        import hla_sp.kernels.hla2_fused_kernels
        import hla_sp.kernels.poison_kernels  # noqa: F401
        import triton
        from hla_sp.kernels._jit import KERNELS
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction

        fn = JITFunction(KERNELS[job["kernel"]].fn)
        src = ASTSource(fn, dict(job["signature"]), dict(job["constexprs"]))
        compiled = triton.compile(
            src, target=GPUTarget("cuda", ARCHS[arch], 32),
            options={"num_warps": job["num_warps"], "num_stages": job["num_stages"]},
        )
        out["shared"] = int(compiled.metadata.shared)
        with tempfile.TemporaryDirectory() as tmp:
            ptx = Path(tmp) / "k.ptx"
            ptx.write_text(compiled.asm["ptx"])
            r = subprocess.run(
                [*_ptxas(arch), f"--gpu-name={arch}", str(ptx), "-o", str(Path(tmp) / "k.o")],
                capture_output=True, text=True, timeout=600,
            )
        if r.returncode != 0:
            raise RuntimeError(f"ptxas failed: {r.stderr[-2000:]}")
        info = r.stdout + r.stderr
        regs = re.search(r"Used (\d+) registers", info)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
        out["registers"] = int(regs.group(1)) if regs else None
        out["spill_stores"] = int(spill.group(1)) if spill else 0
        out["spill_loads"] = int(spill.group(2)) if spill else 0
        out["error"] = None
    except Exception as e:  # a compile error is a result, reported by the gate
        out["error"] = f"{type(e).__name__}: {str(e)[-1500:]}"
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(out))
    return out


def compile_all(configs: list[dict[str, Any]], workers: int | None = None) -> list[dict]:
    """Every configuration for every arch, in parallel fresh processes; rows for the report."""
    src_hash = _source_hash()
    # a candidate tuned on some archs only (its job's "archs") is compiled for those
    jobs = [(c, arch) for c in configs for arch in ARCHS
            if "archs" not in c or ARCHS[arch] in c["archs"]]
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    env_before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"  # spawned workers import triton for the GPU
    try:
        ctx = mp.get_context("spawn")
        with cf.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            futs = [pool.submit(_compile_one, c, arch, src_hash) for c, arch in jobs]
            results = [f.result() for f in futs]
    finally:
        if env_before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = env_before
    rows = []
    for (c, arch), res in zip(jobs, results, strict=True):
        res = {k: v for k, v in res.items() if k != "job"}
        rows.append({**_describe(c), **res, "arch": arch, "default": c["default"],
                     "used_by": c["used_by"]})
    return rows


def _describe(c: dict[str, Any]) -> dict[str, Any]:
    """The report's view of one configuration: kernel, dtype, tiles, warps, stages."""
    sig, ce = c["signature"], c["constexprs"]
    first_ptr = next(t for t in sig.values() if t.startswith("*"))
    dtype = first_ptr[1:]
    if ce.get("DOT_PREC") == "tf32":
        dtype += "/tf32"
    tiles = {n: ce[n] for n in ("BT", "BK", "BV", "BX", "BY") if n in ce}
    flags = {n: ce[n] for n in ce if n.startswith(("HAS_", "CARRY", "REVERSE", "STORE"))}
    return {"kernel": c["kernel"], "dtype": dtype, "tiles": tiles, "flags": flags,
            "num_warps": c["num_warps"], "num_stages": c["num_stages"]}


# --------------------------------------------------------------------------- gate


def failures(rows: list[dict], kernels: list[str]) -> list[str]:
    """Everything the gate refuses, one line each (module doc, step 3). A small spill may
    cost less than the smaller tiles that avoid it: tiles are chosen by time."""
    from hla_sp.kernels._tiles import SPILL_LIMIT
    bad = []
    launched = {r["kernel"] for r in rows}
    for name in kernels:
        if name not in launched:
            bad.append(f"{name}: never launched by the public API")
    for r in rows:
        where = f"{r['kernel']} {r['arch']} {r['dtype']} {r['tiles']} {r['flags']} " \
                f"w{r['num_warps']} s{r['num_stages']} (e.g. {r['used_by'][0]})"
        if r.get("error"):
            bad.append(f"{where}: compile error: {r['error']}")
            continue
        if r["shared"] > SHARED_LIMIT[r["arch"]]:
            bad.append(f"{where}: shared memory {r['shared']} B > {SHARED_LIMIT[r['arch']]} B")
        if spill_bytes(r) > SPILL_LIMIT:
            bad.append(f"{where}: spills {r['spill_stores']} B stored, "
                       f"{r['spill_loads']} B loaded")
    return bad


def summary_table(rows: list[dict]) -> str:
    """Markdown: per kernel, arch and dtype, the worst configuration (most spill bytes,
    then shared memory) with its tiles, warps, stages, shared, registers and spills."""
    worst: dict[tuple[str, str, str], dict] = {}
    count: dict[tuple[str, str, str], int] = {}
    for r in rows:
        if r.get("error"):
            continue
        key = (r["kernel"], r["arch"], r["dtype"])
        count[key] = count.get(key, 0) + 1
        score = (r["spill_stores"] + r["spill_loads"], r["shared"], r["registers"] or 0)
        if key not in worst or score > worst[key]["_score"]:
            worst[key] = {**r, "_score": score}
    lines = [
        "| kernel | arch | dtype | configs | worst: tiles | warps | stages | shared (B) "
        "| registers | spills st/ld (B) | default path |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(worst):
        r = worst[key]
        tiles = " ".join(f"{k}={v}" for k, v in r["tiles"].items())
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {count[key]} | {tiles} | {r['num_warps']} "
            f"| {r['num_stages']} | {r['shared']} | {r['registers']} "
            f"| {r['spill_stores']}/{r['spill_loads']} | {'yes' if r['default'] else 'opt-in'} |"
        )
    return "\n".join(lines)


def write_doc(table: str, n_configs: int, n_rows: int) -> None:
    """Replace the table between the markers in docs/benchmarks.md (appended if absent)."""
    text = DOC.read_text()
    block = (f"{TABLE_BEGIN}\n\n{n_configs} configurations, {n_rows} compiles; per kernel, "
             f"arch and dtype the worst configuration.\n\n{table}\n\n{TABLE_END}")
    if TABLE_BEGIN in text and TABLE_END in text:
        head, rest = text.split(TABLE_BEGIN, 1)
        text = head + block + rest.split(TABLE_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    DOC.write_text(text)


def run(full: bool = True, workers: int | None = None) -> tuple[list[dict], list[str], int]:
    """Capture, compile, gate. Returns (rows, failures, distinct configurations)."""
    configs, kernels = capture(full)
    rows = compile_all(configs, workers)
    return rows, failures(rows, kernels), len(configs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="chunk 64 only")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = ap.parse_args()
    rows, bad, n = run(full=not args.quick, workers=args.workers)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"configs": n, "compiles": len(rows), "failures": bad,
                                   "rows": rows}, indent=1, sort_keys=True))
    table = summary_table(rows)
    if not args.no_doc:
        write_doc(table, n, len(rows))
    print(table)
    print(f"{n} configurations, {len(rows)} compiles, {len(bad)} failures")
    for line in bad:
        print("FAIL", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

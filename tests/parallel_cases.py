"""Shared case runner of the sequence-parallel tests (a helper module: no tests of its own).

A case is a dict; :func:`run_cases` is a World task: every rank builds the same
seeded global tensors, computes the single-process result and its gradients, then
its own shard's result under ``SequenceParallel``, and returns one line per
mismatch (an empty list when every case agrees).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hla_sp.config import BUILTIN_OPERATORS
from hla_sp.ops import table
from hla_sp.ops.runner import run_operator
from hla_sp.parallel import SequenceParallel, positions, shard, split_lengths

# Every built-in operator of the table: a new one is in every case matrix at once.
OPS = tuple(BUILTIN_OPERATORS)
# fp32 acceptance: the sharded fp32 result's distance to the fp64 truth is at most
# FP32_FACTOR times the single-process fp32 result's distance (+ a floor for the
# cases where the single-process error happens to be ~0). The sharded path sums the
# same terms in a different order, so its error is of the same size, not smaller.
FP32_FACTOR = 8.0
FP32_FLOOR = 2e-6
FP64_TOL = 1e-10


def case(op: str, **kw: Any) -> dict:
    """A case with defaults: T=24, B=1, H=2, K=4, V=3, no decay, contiguous allgather."""
    c = dict(op=op, T=24, B=1, H=2, K=4, V=3, decay=None, cu=None, h0=False, final=False,
             layout="contiguous", method="allgather", lengths=None, dtype="float64",
             normalize=False, ridge=0.0, seed=0, chunk=8)
    c.update(kw)
    return c


def _fields(op: str, normalize: bool) -> list[table.Field]:
    """The operator's state fields present for these options (the table's)."""
    on = {"normalize": normalize}
    return [f for f in table.get(op).fields if f.when is None or on.get(f.when)]


def _inputs(c: dict, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(c["seed"])
    B, T, H, K, V = c["B"], c["T"], c["H"], c["K"], c["V"]
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V), w=r(B, T, H, V))
    if c["decay"] == "head":
        x["g"] = -torch.rand(H, generator=gen, dtype=torch.float64) * 0.5
    elif c["decay"] == "token":
        x["g"] = -torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.7
    N = B if c["cu"] is None else len(c["cu"]) - 1
    dims = {"K": K, "V": V}
    fields = _fields(c["op"], c["normalize"])
    shapes = [(N, H, *(dims[d] for d in f.dims)) for f in fields]
    x["h0"] = [r(*shape) * 0.5 for shape in shapes] if c["h0"] else None
    names = [f.name for f in fields]
    if x["h0"] is not None and "S" in names:  # a key moment is symmetric (S = sum k k^T)
        i = names.index("S")
        x["h0"][i] = (x["h0"][i] + x["h0"][i].mT) / 2
    x["wf"] = [r(*shape) for shape in shapes]
    return {k: (None if v is None else [t.to(dtype) for t in v] if isinstance(v, list)
                else v.to(dtype)) for k, v in x.items()}


def _call(c: dict, x: dict, *, sp, rank: int, P: int):
    """One forward+backward; returns (o, finals, grads dict) with leaf grads."""
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v")}
    lengths = c["lengths"] or split_lengths(c["T"], P, c["layout"])
    if sp is not None:
        leaves = {n: shard(t.detach(), rank, P, c["layout"], lengths=lengths).requires_grad_(True)
                  for n, t in leaves.items()}
    g = None
    if "g" in x:
        g = x["g"].clone()
        if g.dim() == 3 and sp is not None:
            g = shard(g, rank, P, c["layout"], lengths=lengths)
        g.requires_grad_(True)
    h0 = None if x["h0"] is None else [t.clone().requires_grad_(True) for t in x["h0"]]
    kw: dict[str, Any] = dict(log_decay=g, output_final_state=c["final"], sp=sp,
                              chunk_size=c["chunk"])
    if c["cu"] is not None:
        kw["cu_seqlens"] = torch.tensor(c["cu"], dtype=torch.int64)
    if h0 is not None:
        kw["initial_state"] = tuple(h0)
    if "normalize" in table.get(c["op"]).options:
        kw.update(normalize=c["normalize"], ridge=c["ridge"])
    o, fin = run_operator(c["op"], leaves["q"], leaves["k"], leaves["v"], **kw)
    w = x["w"] if sp is None else shard(x["w"], rank, P, c["layout"], lengths=lengths)
    loss = (o.double() * w.double()).sum()
    finals = []
    if c["final"]:
        finals = [t for t in fin if t is not None]
        # The global loss is the sum of the ranks' losses: weight each rank's use of
        # the replicated final state so that the weights sum to one.
        share = 1.0 if sp is None else (rank + 1) / (P * (P + 1) / 2)
        for f, wf in zip(finals, x["wf"]):
            loss = loss + share * (f.double() * wf.double()).sum()
    loss.backward()
    grads = {n: t.grad for n, t in leaves.items()}
    if g is not None:
        grads["g"] = g.grad
    if h0 is not None:
        for i, t in enumerate(h0):
            grads[f"h0.{i}"] = t.grad
    return o.detach(), [f.detach() for f in finals], grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def _compare(c: dict, rank: int, P: int, got, ref, *, sharded: bool = True) -> dict[str, tuple]:
    """name -> (result, reference) for everything that must agree.

    ``sharded``: ``got`` is this rank's sharded result, compared with the slice of the
    single-process ``ref``; otherwise both are single-process results (global).
    """
    o, fins, grads = got
    o_ref, fins_ref, grads_ref = ref
    lengths = c["lengths"] or split_lengths(c["T"], P, c["layout"])
    pos = positions(rank, P, c["layout"], lengths) if sharded else torch.arange(c["T"])
    pairs = {"o": (o, o_ref[:, pos])}
    for i, (f, fr) in enumerate(zip(fins, fins_ref)):
        pairs[f"final.{i}"] = (f, fr)
    for n in ("q", "k", "v"):
        want = grads_ref[n][:, pos]
        gr = grads[n] if grads[n] is not None else torch.zeros_like(want)
        pairs[f"d{n}"] = (gr, want)
    for n, gr in sorted(grads.items()):  # the same all-reduce order on every rank
        if n in ("q", "k", "v"):
            continue
        if gr is None:  # this rank's shard does not depend on it
            gr = torch.zeros_like(grads_ref[n], dtype=o.dtype)
        if n == "g" and gr.dim() == 3:
            pairs["dg"] = (gr, grads_ref["g"][:, pos])
        else:
            total = gr.clone()
            if sharded:
                # A replicated input: its gradient is the sum of the ranks' gradients.
                dist.all_reduce(total)
            pairs[f"d{n}"] = (total, grads_ref[n])
    return pairs


def run_cases(rank: int, P: int, cases: list[dict]) -> list[str]:
    """World task: every case on every rank; returns the mismatches seen on this rank."""
    errors = []
    for c in cases:
        tag = {k: v for k, v in c.items() if v not in (None, False) or k == "op"}
        sp = SequenceParallel(layout=c["layout"], method=c["method"])
        if c["dtype"] == "float64":
            x = _inputs(c, torch.float64)
            ref = _call(c, x, sp=None, rank=rank, P=P)
            got = _call(c, x, sp=sp, rank=rank, P=P)
            for name, (a, b) in _compare(c, rank, P, got, ref).items():
                e = _rel(a, b)
                if not e <= FP64_TOL:
                    errors.append(f"rank {rank} {tag}: {name} rel err {e:.3g} > {FP64_TOL}")
        else:
            x64 = _inputs(c, torch.float64)
            truth = _call(c, x64, sp=None, rank=rank, P=P)
            x32 = {k: (None if v is None else [t.float() for t in v] if isinstance(v, list)
                       else v.float()) for k, v in x64.items()}
            single = _call(c, x32, sp=None, rank=rank, P=P)
            got = _call(c, x32, sp=sp, rank=rank, P=P)
            base = _compare(c, rank, P, single, truth, sharded=False)
            for name, (a, b) in _compare(c, rank, P, got, truth).items():
                e, e1 = _rel(a, b), _rel(base[name][0], base[name][1])
                if not e <= FP32_FACTOR * e1 + FP32_FLOOR:
                    errors.append(f"rank {rank} {tag}: {name} fp32 rel err {e:.3g} > "
                                  f"{FP32_FACTOR} x single-process {e1:.3g} + {FP32_FLOOR}")
    return errors

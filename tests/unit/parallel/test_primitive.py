"""Every operator under sequence parallelism equals the single-process result.

One task per world runs the whole case matrix of that world size: every operator,
method and layout; even, uneven and empty shards (first, middle, last rank); decay
per head and per token; packed documents crossing one and several rank boundaries
(one boundary exactly at a shard edge); initial and final states; fp64 to 1e-10
relative and fp32 within a multiple of the single-process fp32 error (see
``parallel_cases``).
"""

from __future__ import annotations

import itertools

import pytest
from parallel_cases import OPS, case, run_cases

from hla_sp.config import SP_METHODS

METHODS = SP_METHODS
LAYOUTS = ("contiguous", "zigzag")


def _docs(P: int, T: int, layout: str) -> list[int]:
    """Document boundaries: one starting exactly at a shard edge, one crossing several."""
    edge = T // max(P, 2) if layout == "contiguous" else T // (2 * P)
    cu = sorted({0, edge, edge + 1, T - 2, T} if edge + 1 < T - 2 else {0, edge, T})
    return cu


def _shard_lengths(P: int, T: int) -> list[list[int] | None]:
    """Contiguous splits: even, uneven, and an empty shard on the first, a middle, the last rank."""
    if P == 1:
        return [None]
    out: list[list[int] | None] = [None]
    uneven = [T // P + (r % 2) * 3 - 1 for r in range(P)]
    uneven[-1] += T - sum(uneven)
    out.append(uneven)
    for empty in sorted({0, P // 2, P - 1}):
        rest = [r for r in range(P) if r != empty]
        ls = [0] * P
        for i, r in enumerate(rest):
            ls[r] = T // len(rest) + (1 if i < T % len(rest) else 0)
        out.append(ls)
    return out


def matrix(P: int, T: int = 24) -> list[dict]:
    """The cases of one world: every op x method x layout, features rotated through."""
    decays = itertools.cycle([None, "head", "token"])
    splits = _shard_lengths(P, T)
    cases = []
    for i, (op, method, layout) in enumerate(itertools.product(OPS, METHODS, LAYOUTS)):
        lengths = splits[i % len(splits)] if layout == "contiguous" else None
        varlen = i % 3 != 1
        cases.append(case(
            op, T=T, method=method, layout=layout, lengths=lengths, decay=next(decays),
            cu=_docs(P, T, layout) if varlen else None, B=1 if varlen else 2,
            h0=i % 2 == 0, final=i % 4 != 3, normalize=op == "hla2" and i % 2 == 0,
            ridge=0.3 if op == "hla2" and i % 3 == 0 else 0.0, seed=i,
        ))
    # fp32: one case per method, varlen with state and decay, compared against fp64 truth.
    for j, method in enumerate(METHODS):
        cases.append(case("hla2", T=T, method=method, layout=LAYOUTS[j % 2], dtype="float32",
                          decay="token", cu=_docs(P, T, LAYOUTS[j % 2]), h0=True, final=True,
                          lengths=splits[-1] if j % 2 == 0 else None, seed=100 + j))
    return cases


@pytest.mark.timeout(400)
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_matches_single_process(world, P: int) -> None:
    errors = world(P).run(run_cases, matrix(P), timeout=360)
    flat = [e for rank_errors in errors for e in rank_errors]
    assert not flat, "\n".join(flat[:20])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_matches_single_process_8_ranks(world) -> None:
    cases = [c for c in matrix(8, T=48) if c["op"] in ("linear", "hla2")]
    errors = world(8).run(run_cases, cases, timeout=800)
    flat = [e for rank_errors in errors for e in rank_errors]
    assert not flat, "\n".join(flat[:20])


def _run_composed(rank: int, P: int, cases: list[dict]) -> list[str]:
    """run_cases with every piece run as zero-state outputs plus the carry's term, the
    composition the Triton kernels use, instead of the torch path's split chunks."""
    from hla_sp.parallel import primitive

    real = primitive._use_split
    primitive._use_split = lambda q: False
    try:
        return run_cases(rank, P, cases)
    finally:
        primitive._use_split = real


@pytest.mark.timeout(400)
@pytest.mark.parametrize("P", [2, 3])
def test_composed_path_matches_single_process(world, P: int) -> None:
    errors = world(P).run(_run_composed, matrix(P), timeout=360)
    flat = [e for rank_errors in errors for e in rank_errors]
    assert not flat, "\n".join(flat[:20])

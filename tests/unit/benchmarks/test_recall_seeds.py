"""The recall study's seeds trained together (benchmarks/recall_seeds.py) are the runs
``bench_recall.train`` makes one at a time: in fp64 every figure of every seed agrees to
1e-10 relative (stacking changes only the order of a few sums), early stops and budget
cuts land where a run alone puts them, and each seed's gradient is clipped by its own
norm."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import bench_recall as BR
import recall_seeds as RS

SETTING = dict(T=16, pairs=2, steps=6, batch=4, lr=3e-3, d=16, eval_every=2)


@pytest.fixture
def fp64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= 1e-10 * max(abs(a), abs(b), 1e-300)


@pytest.mark.parametrize("mixer", ["hla2", "gated-linear", "softmax"])
def test_seeds_together_equal_the_runs_alone(fp64: None, mixer: str) -> None:
    together = RS.train_seeds(mixer, seeds=[0, 1, 2], early_stop=None, **SETTING)
    for r in together:
        alone = BR.train(mixer, seed=r["seed"], early_stop=None, **SETTING)
        assert r["seeds_together"] == 3
        assert [c["step"] for c in r["curve"]] == [c["step"] for c in alone["curve"]] == [2, 4, 6]
        for key in ("acc", "loss", "grad_norm_mean", "grad_norm_max"):
            assert _close(r[key], alone[key]), (key, r[key], alone[key])
        for c, ca in zip(r["curve"], alone["curve"], strict=True):
            assert _close(c["train_loss"], ca["train_loss"]) and _close(c["loss"], ca["loss"])
        assert r["params"] == alone["params"] and r["stopped_at"] is None


def test_early_stops_and_budget_cuts_are_each_seeds(fp64: None) -> None:
    """early_stop 0: every seed stops at its first check, as a run alone does; a budget
    already spent: no step taken, every seed records cut_at 0."""
    stopped = RS.train_seeds("linear", seeds=[0, 1], early_stop=0.0, **SETTING)
    alone = BR.train("linear", seed=1, early_stop=0.0, **SETTING)
    assert [r["stopped_at"] for r in stopped] == [2, 2] == [alone["stopped_at"]] * 2
    assert _close(stopped[1]["loss"], alone["loss"]) and stopped[1]["solved"]
    cut = RS.train_seeds("linear", seeds=[3, 4], deadline=time.time() - 1, **SETTING)
    assert [r["cut_at"] for r in cut] == [0, 0]
    assert all(r["curve"] == [] and r["grad_norm_mean"] is None for r in cut)


def test_clip_per_seed_is_clip_grad_norm_of_each_seed() -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(3, 5, 4, generator=gen), torch.randn(3, 7, generator=gen)]
    for g in grads:
        g[1] *= 1e-3  # seed 1 below the threshold: left as it is
    want, norms = [], []
    for i in range(3):
        ps = [torch.nn.Parameter(torch.zeros_like(g[i])) for g in grads]
        for p, g in zip(ps, grads, strict=True):
            p.grad = g[i].clone()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ps, 1.0)))
        want.append([p.grad for p in ps])
    got = RS.clip_per_seed(grads)
    assert got.tolist() == pytest.approx(norms, rel=1e-6)
    assert norms[1] < 1.0 < min(norms[0], norms[2])
    for i in range(3):
        for g, w in zip(grads, want[i], strict=True):
            torch.testing.assert_close(g[i], w, rtol=1e-6, atol=0)


def test_seeds_are_required() -> None:
    with pytest.raises(ValueError, match=r"seeds: expected at least one seed, got \[\]"):
        RS.train_seeds("linear", seeds=[], **SETTING)


def test_together_groups_the_runs_that_differ_only_by_seed() -> None:
    jobs = [dict(mixer=m, lr=lr, seed=s) for m in ("a", "b") for lr in (1.0, 2.0)
            for s in (0, 1, 2)]
    groups = BR.together(jobs)
    assert len(groups) == 4 and all(g["seeds"] == [0, 1, 2] for g in groups)
    assert {(g["mixer"], g["lr"]) for g in groups} == {("a", 1.0), ("a", 2.0), ("b", 1.0),
                                                      ("b", 2.0)}

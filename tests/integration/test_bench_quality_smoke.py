"""Smoke tests of the quality benchmarks (recall, language modelling, the diagnosis):
they run, write well-formed JSON and a PNG, and the MQAR data is what it claims to be.
Nothing here judges learning: ``make bench-recall`` measures it (docs/quality.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def _run(args: list[str], cwd: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, f"{args} exited {r.returncode}\n{r.stdout}\n{r.stderr}"


def test_mqar_batch_labels_the_values_of_earlier_keys() -> None:
    sys.path.insert(0, str(BENCH))
    from bench_recall import mqar_batch

    x, y = mqar_batch(8, 64, 4, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 64)
    for b in range(8):
        pairs = {int(x[b, i]): int(x[b, i + 1]) for i in range(0, 8, 2)}
        assert all(1 <= k < 128 for k in pairs) and all(128 <= v < 256 for v in pairs.values())
        where = (y[b] != -100).nonzero().flatten().tolist()
        assert len(where) == 4 and min(where) >= 8
        for t in where:  # a queried key, labelled with the value it was paired with
            assert int(y[b, t]) == pairs[int(x[b, t])]
        assert int((x[b, 8:] == 0).sum()) == 56 - 8  # the rest is the filler 0


def test_recall_and_lm_quick_runs_write_json_and_png(tmp_path: Path) -> None:
    _run([str(BENCH / "bench_recall.py"), "--quick", "--mixers", "softmax,linear,hla3",
          "--jobs", "1", "--out", str(tmp_path)], tmp_path)
    res = json.loads((tmp_path / "recall.json").read_text())
    assert [r["mixer"] for r in res["results"]] == ["softmax", "linear", "hla3"]
    for r in res["results"]:
        assert 0.0 <= r["acc"] <= 1.0 and r["curve"] and r["curve"][-1]["step"] == r["steps"]
    assert (tmp_path / "recall.png").stat().st_size > 0
    _run([str(BENCH / "bench_lm.py"), "--quick", "--mixers", "linear,hla2", "--jobs", "1",
          "--out", str(tmp_path), "--save-models", str(tmp_path / "models")], tmp_path)
    lm = json.loads((tmp_path / "lm.json").read_text())
    assert {r["mixer"] for r in lm["results"]} == {"linear", "hla2"}
    assert all(0 < r["valid_loss"] < 10 for r in lm["results"])
    assert (tmp_path / "lm.png").stat().st_size > 0
    table = subprocess.run([sys.executable, str(BENCH / "bench_lm.py"), "--table", "--out",
                            str(tmp_path)], capture_output=True, text=True, timeout=120,
                           check=True).stdout.splitlines()
    rows = {line.split(" | ")[0].strip("| ") for line in table[2:]}
    assert rows == {"linear", "hla2"}, table
    for r in lm["results"]:  # each seed's figure, as the JSON holds it
        assert any(f"{r['seed']}: {r['valid_bpb']:.3f}" in line for line in table), table


def test_recall_results_load_with_the_solved_rule(tmp_path: Path) -> None:
    """A run stored with a stale flag (an early stop at 0.99 whose larger final check read
    0.987) loads as solved; a run that neither stopped nor reached 0.99 does not."""
    sys.path.insert(0, str(BENCH))
    from bench_recall import load_results

    runs = [{"stopped_at": 2500, "acc": 0.987, "solved": False},
            {"stopped_at": None, "acc": 0.991, "solved": False},
            {"stopped_at": None, "acc": 0.985, "solved": True}]
    path = tmp_path / "grid.json"
    path.write_text(json.dumps({"results": runs}))
    assert [r["solved"] for r in load_results(path)] == [True, True, False]


def _square(kw: dict) -> dict:
    return {"k": kw["k"], "v": kw["k"] ** 2}


def test_grid_runs_keep_what_another_writer_stored(tmp_path: Path) -> None:
    """Two parts of a grid writing one file: each save keeps the other's runs (one copy
    of a run both hold), and the file is whole JSON after every save."""
    sys.path.insert(0, str(BENCH))
    from grid_runs import run_parallel, save_merged

    path = tmp_path / "grid.json"

    def load(p: Path) -> list[dict]:
        return json.loads(p.read_text())["results"]

    def key(r: dict) -> tuple:
        return (r["k"],)

    def data(rs: list[dict]) -> dict:
        return {"n": len(rs), "results": rs}

    a: list[dict] = []
    b: list[dict] = []
    for part, k in ((a, 1), (b, 2), (a, 3), (b, 1)):
        part.append(_square({"k": k}))
        save_merged(path, part, key, load, data)
        stored = json.loads(path.read_text())
        assert stored["n"] == len(stored["results"])
    assert sorted(r["k"] for r in load(path)) == [1, 2, 3]
    assert not path.with_suffix(".tmp").exists()

    got: list[dict] = []
    run_parallel(_square, [{"k": k} for k in range(4)], 2, got.append)
    assert sorted((r["k"], r["v"]) for r in got) == [(0, 0), (1, 1), (2, 4), (3, 9)]


def test_recall_mix_weights_get_their_own_rate() -> None:
    """hla2-slowmix puts every key_mix/value_mix in a group at 0.1x the rate, the rest at
    the rate; at rate 1, or without mix weights, there is one group."""
    sys.path.insert(0, str(BENCH))
    from bench_recall import MIXERS, RecallLM, param_groups

    model = RecallLM("hla2-slowmix", 16)
    groups = param_groups(model, 3e-3, MIXERS["hla2-slowmix"]["mix_lr"])
    assert len(groups) == 2 and groups[1]["lr"] == pytest.approx(3e-4)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)].rsplit(".", 1)[-1] for p in groups[1]["params"]) == [
        "key_mix", "key_mix"]  # one per layer; hla2 has no value_mix
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    assert len(param_groups(RecallLM("hla2", 16), 3e-3, 1.0)) == 1
    assert len(param_groups(RecallLM("linear", 16), 3e-3, 0.1)) == 1  # no mix weights


def test_lm_trains_with_the_variants_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_lm builds its optimiser with the variant's own rate for the mix weights (a
    variant like hla2-fastmix must not run as plain hla2): one step, the groups checked."""
    sys.path.insert(0, str(BENCH))
    import bench_lm

    seen: list[list[float]] = []
    real = bench_lm.make_optimizer

    def spy(model: torch.nn.Module, mixer: str, lr: float) -> torch.optim.AdamW:
        opt = real(model, mixer, lr)
        seen.append([g["lr"] for g in opt.param_groups])
        return opt

    monkeypatch.setattr(bench_lm, "make_optimizer", spy)
    r = bench_lm.train("hla2-fastmix", T=16, steps=1, batch=2, d=16, layers=1, heads=2,
                       lr=1e-3, seed=0, evals=1, n_tokens=20_000, valid_bytes=256)
    assert r["options"]["mix_lr"] == 10.0
    assert seen == [[1e-3, pytest.approx(1e-2)]]


def test_recall_negmix_starts_every_key_mix_below_zero() -> None:
    """hla2-negmix starts a at -0.05 in every head of every layer; hla2 starts it at 0."""
    sys.path.insert(0, str(BENCH))
    from bench_recall import RecallLM

    neg = [b["mix"].heads.key_mix for b in RecallLM("hla2-negmix", 16).blocks]
    assert len(neg) == 2 and all(torch.equal(a, torch.full_like(a, -0.05)) for a in neg)
    assert all(not b["mix"].heads.key_mix.any() for b in RecallLM("hla2", 16).blocks)


def test_recall_jitter_moves_every_weight_by_about_its_scale() -> None:
    """linear-jitter is linear's start (same seed) with each weight scaled by
    1 + O(1e-6): within 1e-5 relative of it, and not equal to it."""
    sys.path.insert(0, str(BENCH))
    from bench_recall import RecallLM

    torch.manual_seed(0)
    ref = RecallLM("linear", 16).state_dict()
    torch.manual_seed(0)
    jit = RecallLM("linear-jitter", 16).state_dict()
    assert ref.keys() == jit.keys()
    rel = max(((jit[k] - ref[k]).abs() / ref[k].abs().clamp_min(1e-30)).max().item()
              for k in ref)
    assert 1e-7 < rel < 1e-5
    assert any(not torch.equal(jit[k], ref[k]) for k in ref)


def test_gpu_quality_study_runs_at_a_toy_size_on_cpu(tmp_path: Path) -> None:
    """``make gpu-quality``'s code, at a toy size on the CPU: every mixer of the study
    trains two seeds together in one process and the table is printed; the plan counts
    each mixer's FLOPs."""
    sys.path.insert(0, str(BENCH))
    import gpu_quality

    assert gpu_quality.main(["--device", "cpu", "--toy", "--jobs", "1",
                             "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "recall_gpu.json").read_text())
    assert sorted((r["mixer"], r["seed"]) for r in res["results"]) == sorted(
        (m, s) for m in gpu_quality.MIXERS for s in (0, 1))
    assert all(r["device"] == "cpu" and "cut_at" not in r and r["seeds_together"] == 2
               for r in res["results"])
    p = gpu_quality.plan(T=32, d=16, seeds=2, steps=10)
    # hla2 runs two primitive stages where linear runs one; softmax is quadratic in T
    mix = {m: r["mixer_gflop"] for m, r in p["per_mixer"].items()}
    assert mix["hla2"] == pytest.approx(2 * mix["linear"]) and mix["softmax"] > 0
    assert p["total_pflop"] > 0


def test_gpu_quality_plan_reads_the_measured_pace(tmp_path: Path) -> None:
    """The plan's measured block: steps a second per run up to where the budget cut it,
    and the minutes the whole schedule would take at that pace."""
    sys.path.insert(0, str(BENCH))
    import gpu_quality

    runs = [{"mixer": "hla2", "steps": 1000, "cut_at": 100, "seconds": 50.0},
            {"mixer": "hla2", "steps": 1000, "cut_at": 300, "seconds": 50.0},
            {"mixer": "linear", "steps": 1000, "seconds": 100.0}]  # finished: all steps
    path = tmp_path / "study.json"
    path.write_text(json.dumps({"results": runs}))
    pace = gpu_quality.measured_pace(path, steps=1200)
    assert pace["runs_at_once"] == 3 and pace["processes"] == 3
    assert pace["hla2"]["steps_per_s_per_run"] == pytest.approx(4.0)
    assert pace["hla2"]["minutes_for_schedule"] == pytest.approx(5.0)
    assert pace["linear"]["steps_per_s_per_run"] == pytest.approx(10.0)
    assert pace["steps_per_s_total"] == pytest.approx(2 + 6 + 10)
    assert gpu_quality.measured_pace(tmp_path / "none.json", steps=10) is None
    # 3 runs of one seed each at 18 steps/s in all: 4 seeds to a kernel make 72 seed-steps/s
    model = gpu_quality.together_model(pace, seeds=4, steps=90)
    assert model["seed_steps_per_s"] == pytest.approx(72.0)
    assert model["minutes"] == pytest.approx(len(gpu_quality.MIXERS) * 4 * 90 / 72 / 60)


def test_recall_budget_cuts_runs_and_says_where(tmp_path: Path) -> None:
    """A budget already spent: no run takes a step, each records cut_at 0, and the
    grid still writes its figures (nothing is silently dropped)."""
    _run([str(BENCH / "bench_recall.py"), "--quick", "--mixers", "linear,hla2", "--jobs", "1",
          "--budget-s", "0", "--out", str(tmp_path)], tmp_path)
    res = json.loads((tmp_path / "recall.json").read_text())
    assert [r["cut_at"] for r in res["results"]] == [0, 0]


def test_context_use_scores_the_kept_models(tmp_path: Path) -> None:
    """bench_lm --save-models keeps models that load back with their validation loss, and
    bench_context_use scores each on held-out text by position and on passkeys."""
    _run([str(BENCH / "bench_lm.py"), "--quick", "--mixers", "linear", "--jobs", "1",
          "--out", str(tmp_path), "--save-models", str(tmp_path / "models")], tmp_path)
    _run([str(BENCH / "bench_context_use.py"), "--models", str(tmp_path / "models"),
          "--ppl-length", "256", "--passkey-lengths", "128,256", "--passkey-samples", "2",
          "--out", str(tmp_path)], tmp_path)
    res = json.loads((tmp_path / "context_use.json").read_text())
    lm = json.loads((tmp_path / "lm.json").read_text())["results"][0]
    (r,) = res["results"]
    assert r["mixer"] == "linear" and r["T"] == 32
    assert abs(r["valid_bpb_at_T"] - lm["valid_bpb"]) < 1e-9  # the model kept is the one scored
    assert [(b["lo"], b["hi"]) for b in r["ppl"]] == [(0, 32), (32, 64), (64, 128), (128, 256)]
    assert all(0 < b["bits_per_byte"] < 10 for b in r["ppl"])
    assert {(p["length"], p["depth"]) for p in r["passkey"]} == {
        (n, d) for n in (128, 256) for d in (0.0, 0.5, 1.0)}
    assert all(0 <= p["digit_accuracy"] <= 1 for p in r["passkey"])
    assert (tmp_path / "context_use.png").stat().st_size > 0
    table = subprocess.run([sys.executable, str(BENCH / "bench_context_use.py"), "--table",
                            "--out", str(tmp_path)], capture_output=True, text=True,
                           timeout=120, check=True).stdout.splitlines()
    assert table[2].startswith("| linear | 0 | ") and len(table) == 3, table
    assert f"{r['ppl'][-1]['bits_per_byte']:.3f}" in table[2]

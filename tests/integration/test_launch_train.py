"""The trainer under torchrun: CP=1 equals CP=2, resume equals an uninterrupted run."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from conftest import tiny_flags
from hla_sp.launch.distributed.local import LocalRun, run_local

TINY = tiny_flags(2, 64, "--train-iters", "6", "--lr", "3e-3", "--seed", "7",
    "--micro-batch-size", "2")


def _ok(run: LocalRun, iters: int) -> LocalRun:
    assert run.returncode == 0, run.output[-4000:]
    assert [r["iteration"] for r in run.records][-1] == iters, run.output[-4000:]
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LocalRun | Path]:
    """Three launches shared by the tests below (each launch costs seconds of imports)."""
    d = tmp_path_factory.mktemp("train")
    cp1 = run_local([*TINY, "--context-parallel-size", "1"], 1, str(d / "cp1.jsonl"), timeout=300)
    # CP=2, also with full activation recompute (it must not change a loss), saving at 3
    ckpt = d / "ckpt"
    cp2 = run_local(
        [*TINY, "--context-parallel-size", "2", "--recompute-granularity", "full",
         "--save", str(ckpt), "--save-interval", "3"],
        2, str(d / "cp2.jsonl"), timeout=300,
    )  # fmt: skip
    _ok(cp2, 6)
    # a fresh process resumes from iteration 3 and stops at 5
    resumed = run_local(
        [*TINY, "--context-parallel-size", "2", "--recompute-granularity", "full",
         "--load", str(ckpt), "--ckpt-step", "3", "--exit-interval", "5"],
        2, str(d / "resumed.jsonl"), timeout=300,
    )  # fmt: skip
    return {"cp1": _ok(cp1, 6), "cp2": cp2, "resumed": _ok(resumed, 5), "ckpt": ckpt}


def test_cp1_and_cp2_give_the_same_losses(runs: dict) -> None:
    l1, l2 = runs["cp1"].losses, runs["cp2"].losses
    assert len(l1) == len(l2) == 6
    # fp32 forward/backward in a different summation order (zigzag halves, scan across
    # ranks): agreement to ~1e-6 relative; an error in the cross-rank scan moves the
    # loss at the first digit, and its effect grows over the steps.
    for a, b in zip(l1, l2):
        assert math.isclose(a, b, rel_tol=2e-5), (l1, l2)
    assert sum(l1[-2:]) / 2 < l1[0]  # and it learns


def test_records_carry_the_documented_fields(runs: dict) -> None:
    rec = runs["cp2"].records[0]
    for key in ("iteration", "loss", "tokens_per_s", "peak_mem_bytes", "seq_length", "cp"):
        assert key in rec
    assert rec["cp"] == 2 and rec["seq_length"] == 64 and rec["tokens_per_s"] > 0
    assert len(rec["peak_mem_bytes_per_rank"]) == 2 and rec["peak_mem_bytes"] > 2**20
    out = runs["cp2"].output
    assert "tok/s" in out and "peak mem" in out and "cp2.jsonl" in out


def test_checkpoints_are_complete_and_weights_only(runs: dict) -> None:
    ckpt: Path = runs["ckpt"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["iter_0000003", "iter_0000006"]
    assert not list(ckpt.glob("*.tmp*")) and not list(ckpt.glob("*/*.tmp*"))
    names = sorted(p.name for p in (ckpt / "iter_0000003").iterdir())
    # config.json: what --load compares before any process group (no weights read);
    # model_optim: the tensors, a torch.distributed.checkpoint directory
    assert names == ["common.pt", "config.json", "manifest.json", "model_optim",
                     "rng_rank00000.pt", "rng_rank00001.pt"]
    saved = json.loads((ckpt / "iter_0000003" / "config.json").read_text())
    assert saved["model"]["seq_length"] == 64
    assert (ckpt / "iter_0000003" / "model_optim" / ".metadata").is_file()
    for name in ("common.pt", "rng_rank00000.pt", "rng_rank00001.pt"):
        torch.load(ckpt / "iter_0000003" / name, weights_only=True)


def test_resume_equals_uninterrupted_bitwise(runs: dict) -> None:
    full, resumed = runs["cp2"], runs["resumed"]
    assert "resumed at iteration 3" in resumed.output
    assert "--exit-interval 5: stopping at 5" in resumed.output
    assert [r["iteration"] for r in resumed.records] == [4, 5]
    assert resumed.losses == full.losses[3:5]  # bitwise: floats compared exactly
    assert [r["lr"] for r in resumed.records] == [r["lr"] for r in full.records[3:5]]
    assert [r["grad_norm"] for r in resumed.records] == [r["grad_norm"] for r in full.records[3:5]]


def test_rng_state_round_trips() -> None:
    """Every RNG the trainer saves comes back exactly (dropout draws from these)."""
    import random

    import numpy as np
    from hla_sp.launch.checkpoint import rng_state, set_rng_state

    torch.manual_seed(3)
    random.seed(4)
    np.random.seed(5)
    state = rng_state()
    want = (torch.rand(4), random.random(), np.random.rand())
    torch.rand(7)
    random.random()
    np.random.rand(3)
    set_rng_state(state)
    got = (torch.rand(4), random.random(), np.random.rand())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]


def test_save_is_atomic_when_interrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that dies before its directory is renamed leaves the previous checkpoint
    as the latest, complete and loadable."""
    import torch.distributed as dist
    from hla_sp.launch import checkpoint

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(model.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, 1)
        kw = dict(rank=0, world_size=1, tp_rank=0, writes_model=True, model=model,
                  optimizer=opt, scheduler=sched, consumed_samples=10, config={})  # fmt: skip
        checkpoint.save(str(tmp_path / "c"), 1, **kw)
        real_replace = os.replace

        def crash_on_dir_rename(src: str, dst: str) -> None:
            if str(src).endswith(".tmp") and os.path.isdir(src):
                raise OSError("simulated crash during save")
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", crash_on_dir_rename)
        saved = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.add_(1.0)
        with pytest.raises(OSError, match="simulated crash"):
            checkpoint.save(str(tmp_path / "c"), 2, **{**kw, "consumed_samples": 20})
        monkeypatch.setattr(os, "replace", real_replace)
        assert checkpoint.latest_iteration(str(tmp_path / "c")) == 1
        assert not (tmp_path / "c" / "iter_0000002").exists()
        fresh = torch.nn.Linear(3, 2)
        fresh_opt = torch.optim.AdamW(fresh.parameters())
        pos = checkpoint.load(str(tmp_path / "c"), rank=0, world_size=1, tp_rank=0, model=fresh,
                              optimizer=fresh_opt, scheduler=sched)  # fmt: skip
        assert pos == {"iteration": 1, "consumed_samples": 10, "extra": {}}
        assert torch.equal(fresh.weight, saved)
    finally:
        dist.destroy_process_group()

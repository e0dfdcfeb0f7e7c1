"""--use-distributed-optimizer under torchrun: the same losses and weights as the
unsharded run at DP 2 and CP 2 x DP 2, checkpoints that load with and without the flag
at other DP, CP and TP sizes, a bitwise resume, and --fp16."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import tiny_flags
from hla_sp.launch.distributed.local import LocalRun, run_local

TINY = tiny_flags(2, 64, "--train-iters", "4", "--lr", "3e-3", "--seed", "7",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--bf16")
FLAG = "--use-distributed-optimizer"


def _ok(run: LocalRun, iters: list[int]) -> LocalRun:
    assert run.returncode == 0, run.output[-4000:]
    assert [r["iteration"] for r in run.records] == iters, run.output[-4000:]
    return run


def _tensors(ckpt: Path, it: int) -> dict[str, torch.Tensor]:
    """Every whole tensor of a checkpoint (model, fp32 masters, moments)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent / f"{ckpt.name}_{it}.pt"
    dcp_to_torch_save(str(ckpt / f"iter_{it:07d}" / "model_optim"), str(out))
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LocalRun | Path]:
    d = tmp_path_factory.mktemp("dopt")

    def launch(name: str, n: int, *args: str) -> LocalRun:
        return run_local([*TINY, *args], n, str(d / f"{name}.jsonl"), timeout=400)

    save = ["--save-interval", "2"]
    out: dict[str, LocalRun | Path] = {}
    out["plain"] = _ok(launch("plain", 2, "--save", str(d / "plain"), *save), [1, 2, 3, 4])
    out["dp2"] = _ok(launch("dp2", 2, FLAG, "--save", str(d / "dp2"), *save), [1, 2, 3, 4])
    cp2 = ["--context-parallel-size", "2"]
    out["cp2dp2_plain"] = _ok(launch("cp2dp2_plain", 4, *cp2), [1, 2, 3, 4])
    out["cp2dp2"] = _ok(launch("cp2dp2", 4, FLAG, *cp2), [1, 2, 3, 4])
    # the same layout resumed from iteration 2: bitwise
    out["resumed"] = _ok(launch("resumed", 2, FLAG, "--load", str(d / "dp2"),
                                "--ckpt-step", "2"), [3, 4])
    # the flag's checkpoint without the flag, at TP 2 (DP 1)
    out["tp2_plain"] = _ok(launch("tp2_plain", 2, "--tensor-model-parallel-size", "2",
                                  "--load", str(d / "dp2"), "--ckpt-step", "2"), [3, 4])
    # a checkpoint without the flag, loaded with it at TP 2 x DP 2
    out["tp2dp2"] = _ok(launch("tp2dp2", 4, FLAG, "--tensor-model-parallel-size", "2",
                               "--load", str(d / "plain"), "--ckpt-step", "2"), [3, 4])
    out["dir"] = d
    return out


def _close(a: list[float], b: list[float], rel: float = 1e-5) -> None:
    assert len(a) == len(b) and all(math.isclose(x, y, rel_tol=rel) for x, y in zip(a, b)), \
        (a, b)


def test_losses_equal_the_unsharded_run(runs: dict) -> None:
    # bf16 compute from fp32 masters: the sharded run sums each microbatch's gradient
    # in another order (reduce-scatter per microbatch, not one all-reduce), a few fp32
    # ulps, which can move a bf16 rounding of a weight by one bf16 ulp. Measured: 3 of
    # 40,656 weights at iteration 2, the loss of iteration 3 then 2e-8 apart and of
    # iteration 4 1.5e-5. A sharding error (a wrong shard, a missed reduction) changes an
    # update by a share of the step, whose loss moves 1e-2 a step here: 1e-4 tells them
    # apart, as across TP sizes below.
    plain = runs["plain"].losses
    _close(runs["dp2"].losses, plain, rel=1e-4)
    _close(runs["cp2dp2"].losses, runs["cp2dp2_plain"].losses, rel=1e-4)
    assert plain[-1] < plain[0]


def test_weights_and_moments_equal_the_unsharded_run(runs: dict) -> None:
    """Masters, moments and bf16 weights of the sharded run against the unsharded one.

    At iteration 2 the masters and moments agree to fp32 rounding (measured: 3.3e-7 of
    the largest). A master a few fp32 ulps off can round the other way in bf16, one bf16
    ulp (measured: 0, then 3 of 40,656 weights at iteration 2 as the summation order of
    the operators' fp32 work changed); from then on every gradient of the two runs
    differs a little, and the moments with it (iteration 4, measured: 8e-4 of the
    largest; a bf16 weight near zero may then be several of its own ulps apart, within
    the masters' bound). Both iterations are held to what such flips explain; a real
    sharding error (a wrong shard, a missed reduction) moves most elements by O(1) and
    fails at both."""
    d = runs["dir"]
    # flips at iteration 4: once two weights differ, every later gradient differs a
    # little, and each master rounds the other way with the odds of its offset over a
    # bf16 ulp (measured 8, then 591 of 40,656 as the operators' summation order
    # changed): not counted there, the per-weight and fp32 bounds hold
    for it, rel_fp32, flip_share in ((2, 1e-5, 1e-3), (4, 5e-3, 1.0)):
        a, b = _tensors(d / "plain", it), _tensors(d / "dp2", it)
        # the same keys: the flag's checkpoint is the format of a run without it
        assert sorted(a) == sorted(b)
        assert any(k.startswith("optimizer.state.fp32_param.") for k in a)
        assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in a)
        flips = n16 = 0
        for k in a:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            x, y = a[k].float(), b[k].float()
            if a[k].dtype == torch.float32:  # masters and moments
                assert (x - y).abs().max() <= rel_fp32 * x.abs().max(), (it, k)
            else:  # bf16 weights: one bf16 ulp apart, or as far as their masters may be
                # (a weight near zero whose update moved with the moments)
                tol = 2**-7 * x.abs() + rel_fp32 * x.abs().max()
                assert ((x - y).abs() <= tol).all(), (it, k, (x - y).abs().max())
                flips, n16 = flips + int((x != y).sum()), n16 + x.numel()
        assert flips <= flip_share * n16, (it, flips, n16)


def test_resume_is_bitwise(runs: dict) -> None:
    assert runs["resumed"].losses == runs["dp2"].losses[2:]
    assert [r["grad_norm"] for r in runs["resumed"].records] == [
        r["grad_norm"] for r in runs["dp2"].records[2:]]


def test_checkpoints_load_with_and_without_the_flag_across_tp(runs: dict) -> None:
    # another TP size: another summation order of the matmuls, fp32 rounding
    _close(runs["tp2_plain"].losses, runs["dp2"].losses[2:], rel=1e-4)
    _close(runs["tp2dp2"].losses, runs["plain"].losses[2:], rel=1e-4)


def test_the_flag_shards_the_optimizer_state() -> None:
    """One process group of one rank is enough to see the API: whole tensors at DP x CP
    1; the per-rank halving is measured in docs/benchmarks.md."""
    import torch.distributed as dist
    from hla_sp.launch.checkpoint.sharded import describe_model, unsharded_layout
    from hla_sp.launch.distributed.dist_optimizer import (
        optimizer_state_bytes,
        shard_model,
        shard_rows,
    )

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0,
                                world_size=1)
    try:
        model = torch.nn.Linear(6, 5).to(torch.bfloat16)
        shard_model(model, dist.group.WORLD, torch.bfloat16, unsharded_layout(model))
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert shard_rows(model.weight) == (0, 5)
        # the checkpoint's pieces: the shards' rows at their places
        pieces = describe_model(model, True)
        assert [(p.key, p.offsets, tuple(p.tensor.shape)) for p in pieces.pieces] == [
            ("weight", (0, 0), (5, 6)), ("bias", (0,), (5,))]
        opt = torch.optim.AdamW(model.parameters())
        model(torch.ones(2, 6, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        # masters and two moments: 3 x 4 bytes x 35 parameters
        assert optimizer_state_bytes(opt) == 3 * 4 * 35
    finally:
        dist.destroy_process_group()


def test_the_memory_model_counts_the_flag() -> None:
    from hla_sp.launch.config.train_config import parse_args
    from hla_sp.launch.model.estimate import advice, estimate

    base = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
            "--seq-length", "64", "--bf16", "--context-parallel-size", "2"]
    whole, on = parse_args(base), parse_args([*base, FLAG])
    a, b = estimate(whole, 8), estimate(on, 8)  # DP 4 x CP 2: the state over 8 ranks
    assert a.state_bytes == a.params_per_rank * 20
    assert b.state_bytes == a.params_per_rank * (4 + 16 // 8)
    fp32 = estimate(parse_args([*base[:-3], "--context-parallel-size", "2", FLAG]), 8)
    assert fp32.state_bytes == a.params_per_rank * (8 + 16 // 8)
    assert "--use-distributed-optimizer (AdamW's state over DP x CP = 8)" in advice(whole, 8)
    assert "--use-distributed-optimizer" not in advice(on, 8)
    # one rank of DP x CP: nothing to shard over, nothing to advise
    assert "--use-distributed-optimizer" not in advice(parse_args(base[:-2]), 1)


def test_fp16_with_the_flag_equals_fp16_without(tmp_path: Path) -> None:
    """--fp16 (a static scale, so every step updates): the unscale and the overflow
    check run on each rank's gradient rows; the same losses and norms as without."""
    fp16 = [*TINY[:-1], "--fp16", "--loss-scale", "1024", "--train-iters", "3"]
    a, b = (_ok(run_local([*fp16, *extra], 2, str(tmp_path / f"{i}.jsonl"), timeout=400),
                [1, 2, 3]) for i, extra in enumerate([[], [FLAG]]))
    _close(b.losses, a.losses)
    _close([r["grad_norm"] for r in b.records], [r["grad_norm"] for r in a.records])
    assert not any(r["skipped"] for r in a.records + b.records)

"""A run whose loss or gradient norm goes non-finite stops before the optimizer step,
saves and prunes nothing, says so in one line naming the iteration, the value and the
checkpoint to resume from, and exits non-zero (Megatron's
--check-for-nan-in-loss-and-grad, on by default). --keep-last keeps the newest finite
checkpoint and the one the run loaded (the check turned off:
tests/integration/test_nonfinite_probes.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from conftest import tiny_flags
from hla_sp.launch import checkpoint
from hla_sp.launch.config.train_config import parse_args
from hla_sp.launch.distributed.local import run_local
from hla_sp.launch.train.main import run
from hla_sp.launch.train.nonfinite import HINT

TINY = tiny_flags(1, 32, "--lr", "3e-3", "--seed", "7", "--micro-batch-size", "2")
# the reproduction: an absurd constant rate makes the weights blow up
BLOW_UP = ["--override-opt_param-scheduler", "--lr", "1e25", "--min-lr", "1e25",
           "--lr-decay-style", "constant", "--keep-last", "1", "--save-interval", "1"]


def test_the_flag_is_on_by_default_and_has_a_no_form(tmp_path: Path) -> None:
    assert parse_args(TINY).optimizer.check_for_nan_in_loss_and_grad is True
    assert parse_args([*TINY, "--check-for-nan-in-loss-and-grad"]
                      ).optimizer.check_for_nan_in_loss_and_grad
    assert not parse_args([*TINY, "--no-check-for-nan-in-loss-and-grad"]
                          ).optimizer.check_for_nan_in_loss_and_grad
    toml = tmp_path / "run.toml"
    toml.write_text("check_for_nan_in_loss_and_grad = false\n")
    assert not parse_args([*TINY, "--config", str(toml)]).optimizer.check_for_nan_in_loss_and_grad


def test_non_finite_training_stops_in_one_line_with_nothing_saved(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    run(parse_args([*TINY, "--train-iters", "2", "--save", str(ck)]), exit_on_error=False)
    assert not (ck / checkpoint.LOCK).exists()  # released at the normal end
    out = run_local([*TINY, "--context-parallel-size", "2", "--train-iters", "12",
                     "--load", str(ck), "--save", str(ck), *BLOW_UP],
                    2, str(tmp_path / "m.jsonl"), timeout=300)  # fmt: skip
    assert out.returncode != 0, out.output[-3000:]
    # the iterations that finished were finite; the next one is the stop
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in out.records)
    stop = 2 + len(out.records) + 1
    assert stop <= 12, out.output[-3000:]
    lines = [x for x in out.output.splitlines() if "non-finite" in x]
    assert len(lines) == 1, out.output[-3000:]
    what = lines[0].split('non-finite ')[1].split(' at ')[0]
    # a NaN loss comes from the forward of the newest checkpoint's weights: the one before
    # (here the loaded one, which --keep-last 1 kept) is named; else the newest
    forward = what.startswith("loss")
    good = 2 if forward else stop - 1
    first = json.loads((Path(checkpoint.iter_dir(str(ck), 2)) / "manifest.json").read_text())
    losses = {2: first["loss"], **{r["iteration"]: r["loss"] for r in out.records}}
    low = min(losses, key=lambda it: (losses[it], -it))  # the newest of equal losses
    also = (f"; the lowest-loss one is iteration {low} (loss {losses[low]:.4g})"
            if low != good and low <= good else "")
    assert lines[0] == (
        f"hla-sp train: error: non-finite {what} at iteration {stop}: stopped before the "
        f"optimizer step, nothing saved; the last checkpoint whose forward is finite is "
        f"iteration {good} in {ck}: resume with --load {ck} --ckpt-step {good}{also} "
        f"{HINT}"), lines[0]
    assert "loss (nan)" in lines[0] or "grad-norm (" in lines[0], lines[0]
    # --keep-last 1 kept the newest, the one the run loaded and the lowest-loss one
    assert checkpoint.complete_iterations(str(ck)) == sorted({2, stop - 1, low})
    assert checkpoint.latest_iteration(str(ck)) == stop - 1
    body = json.loads((Path(checkpoint.iter_dir(str(ck), stop - 1)) / "manifest.json"
                       ).read_text())
    assert body["finite"] is not forward
    # both ranks' files are in the manifest, which the stop did not touch
    assert {"rng_rank00000.pt", "rng_rank00001.pt"} <= set(body["files"])
    assert f"iter_{stop:07d}" not in out.output  # not saved, not even begun
    assert not (ck / checkpoint.LOCK).exists()  # released on the way out


def test_keep_last_never_deletes_the_newest_finite_or_the_loaded_checkpoint(
    tmp_path: Path, group: None
) -> None:
    import torch

    def save(root: Path, it: int, **kw: object) -> None:
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(model.parameters())
        checkpoint.save(str(root), it, rank=0, world_size=1, tp_rank=0, writes_model=True,
                        model=model, optimizer=opt,
                        scheduler=torch.optim.lr_scheduler.StepLR(opt, 1), consumed_samples=it,
                        config={}, keep_last=1, **kw)  # type: ignore[arg-type]

    a = tmp_path / "a"
    save(a, 1)
    save(a, 2, finite=False)
    save(a, 3, finite=False)
    assert checkpoint.complete_iterations(str(a)) == [1, 3]
    save(a, 4)  # finite again: the older finite one may go now
    assert checkpoint.complete_iterations(str(a)) == [4]
    b = tmp_path / "b"
    save(b, 2)
    save(b, 3, loaded=2)  # resumed from 2 and saving into the same directory
    save(b, 4, loaded=2)
    assert checkpoint.complete_iterations(str(b)) == [2, 4]


def test_the_check_names_the_value_and_leaves_fp16_overflows_to_the_scaler() -> None:
    from hla_sp.launch.train.nonfinite import non_finite

    nan, inf = float("nan"), float("inf")
    assert non_finite(5.0, 2.0, skipped=False) == ""
    assert non_finite(nan, 2.0, skipped=False) == "loss (nan)"
    assert non_finite(5.0, inf, skipped=False) == "grad-norm (inf)"
    assert non_finite(nan, nan, skipped=False) == "loss (nan) and grad-norm (nan)"
    # an fp16 overflow: the scaler skipped the step (its norm is recorded as NaN)
    assert non_finite(5.0, nan, skipped=True) == ""
    assert non_finite(inf, nan, skipped=True) == "loss (inf)"

""""Finite" means finite, and every reader refuses a checkpoint that is not, against
the second pass of probes; one diverging tiny run (in-process, 12 s) serves most:

- the stop names a checkpoint whose forward is finite (not the diverging one just before
  the NaN), with the schedule flag a lower --lr needs, and the resume it names works;
- --keep-last keeps the lowest-loss checkpoint, below the divergence;
- resume, generate, eval and export (--no-verify too) refuse a non-finite checkpoint in
  one line naming the newest finite one;
- an fp16 run's all-inf weights (finite masters) are recorded non-finite;
- without the check, the run trains on with non-finite steps skipped, no traceback;
- export: NaN logits, a symbolic-link --output, a read-only place, one line each;
- eval plans its memory before starting and refuses what will not fit.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hla_sp.launch import checkpoint
from hla_sp.launch.checkpoint import manifest
from hla_sp.launch.config.train_config import parse_args
from hla_sp.launch.train.main import run

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--seed", "7", "--micro-batch-size", "2",
        "--position-embedding-type", "none"]  # fmt: skip
# the divergence: a loss of 7.6e10 at iteration 6, NaN from the forward at 7
DIVERGE = ["--train-iters", "12", "--lr", "1e3", "--min-lr", "1e3", "--lr-decay-style",
           "constant", "--keep-last", "1", "--save-interval", "1"]  # fmt: skip


def _train(argv: list[str]) -> tuple[list[dict[str, Any]], BaseException | None]:
    """Run in this process; the records and what it raised (the group torn down)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    records: list[dict[str, Any]] = []
    try:
        run(parse_args([*TINY, *argv]), on_record=records.append, exit_on_error=False)
        return records, None
    except Exception as e:
        return records, e
    finally:  # run() leaves the group to its caller when it raises
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def diverged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list, str]:
    ck = tmp_path_factory.mktemp("div") / "ck"
    records, err = _train(["--save", str(ck), *DIVERGE])
    assert err is not None and type(err).__name__ == "NonFiniteError", (err, records)
    return ck, records, str(err)


def test_the_stop_names_a_checkpoint_whose_forward_is_finite(diverged: tuple,
                                                            tmp_path: Path) -> None:
    """Probe 4: the named checkpoint went NaN again from its forward at any --lr; the
    hint lacked --override-opt_param-scheduler; --keep-last 1 had pruned the rest."""
    ck, records, line = diverged
    last = records[-1]["iteration"]  # its weights' forward is the NaN loss
    assert line.startswith("non-finite loss (nan)") and f"at iteration {last + 1}" in line
    assert math.isfinite(records[-1]["loss"]) and records[-1]["loss"] > 1e6, records[-1]
    kept = checkpoint.complete_iterations(str(ck))
    best = min(records, key=lambda r: r["loss"])["iteration"]
    assert kept == [best, last], kept  # the lowest-loss one survived --keep-last 1
    assert records[best - 1]["loss"] < records[-1]["loss"]
    assert manifest.is_finite(checkpoint.iter_dir(str(ck), last)) is False
    assert (f"the last checkpoint whose forward is finite is iteration {best} in {ck}: resume "
            f"with --load {ck} --ckpt-step {best}") in line, line
    assert "--override-opt_param-scheduler" in line and "\n" not in line
    # the resume it names, at a lower rate, trains on finite
    records2, err = _train(["--load", str(ck), "--save", str(tmp_path / "on"),
                            "--ckpt-step", str(best),
                            "--train-iters", str(best + 2), "--lr", "1e-4", "--min-lr", "1e-5",
                            "--override-opt_param-scheduler"])  # fmt: skip
    assert err is None and [r["iteration"] for r in records2] == [best + 1, best + 2], err
    assert all(math.isfinite(r["loss"]) for r in records2)


def _one_error(capsys: pytest.CaptureFixture[str], prog: str) -> str:
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    errors = [x for x in err if x.startswith(f"{prog}: error:")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    return errors[0]


def test_every_reader_refuses_a_non_finite_checkpoint(
    diverged: tuple, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Probe 3: eval printed nan nats, generate a traceback, export --no-verify wrote NaN."""
    from hla_sp.launch.eval import command as evaluate
    from hla_sp.launch.export import command as export
    from hla_sp.launch.export import generate

    ck, records, _ = diverged
    bad, best = records[-1]["iteration"], checkpoint.complete_iterations(str(ck))[0]
    want = f"iter_{bad:07d}: recorded non-finite"
    with pytest.raises(checkpoint.CheckpointError, match=f"--ckpt-step {best}"):
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.AdamW(model.parameters())
        checkpoint.load(str(ck), rank=0, world_size=1, tp_rank=0, model=model, optimizer=opt,
                        scheduler=torch.optim.lr_scheduler.StepLR(opt, 1), step=bad)
    assert generate.main(["--load", str(ck), "--ckpt-step", str(bad), "--prompt", "a",
                          "--max-new-tokens", "1"]) == 2
    assert want in _one_error(capsys, "hla-sp generate")
    out = tmp_path / "hf"
    assert export.main(["--load", str(ck), "--ckpt-step", str(bad), "--output", str(out),
                        "--no-verify"]) == 2
    line = _one_error(capsys, "hla-sp export")
    assert want in line and f"pass --ckpt-step {best}" in line and not out.exists()

    def no_torchrun(*a: object, **k: object) -> list[str]:
        raise AssertionError("the workers must not start")

    assert evaluate.main(["--load", str(ck), "--ckpt-step", str(bad), "--task", "passkey",
                          "--lengths", "1k", "--samples", "1", "--depths", "0.5",
                          "--output", str(tmp_path / "ev")], no_torchrun) == 2
    assert want in _one_error(capsys, "hla-sp eval")


def test_export_says_nan_logits_and_follows_a_symlinked_output(
    diverged: tuple, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Probe 7: NaN logits read "differ ... by nan"; a symbolic link --output was replaced
    by a directory, with a traceback and out.old-PID left behind."""
    import shutil

    from hla_sp.launch.export import command as export

    ck, records, _ = diverged
    bad, best = records[-1]["iteration"], checkpoint.complete_iterations(str(ck))[0]
    copy = tmp_path / "old"  # as a checkpoint written before "finite" was recorded
    shutil.copytree(checkpoint.iter_dir(str(ck), bad), checkpoint.iter_dir(str(copy), bad))
    (copy / checkpoint.LATEST).write_text(f"{bad}\n")
    man = copy / f"iter_{bad:07d}" / "manifest.json"
    body = json.loads(man.read_text())
    del body["finite"]
    man.write_text(json.dumps(body))
    assert export.main(["--load", str(copy), "--output", str(tmp_path / "x")]) == 2
    line = _one_error(capsys, "hla-sp export")
    assert "gives non-finite logits (NaN or infinite)" in line and "--ckpt-step" in line, line
    target = tmp_path / "target"
    link = tmp_path / "link"
    link.symlink_to(target)  # a link to a directory still to be made
    assert export.main(["--load", str(ck), "--ckpt-step", str(best), "--output", str(link),
                        "--no-verify"]) == 0, capsys.readouterr().err
    assert link.is_symlink() and (target / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "old", "target"]


def test_export_into_a_read_only_place_is_one_line(
    diverged: tuple, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Probe 7: an 11-line OSError traceback."""
    from hla_sp.launch.export import command as export

    ck, _, _ = diverged
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: the check sees what a user's would
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, m, **k: False if str(p) == str(ro)
                            else real(p, m, **k))
    step = str(checkpoint.complete_iterations(str(ck))[0])
    assert export.main(["--load", str(ck), "--ckpt-step", step, "--output",
                        str(ro / "hf"), "--no-verify"]) == 2
    line = _one_error(capsys, "hla-sp export")
    assert f"its parent directory {ro} is not writable" in line, line
    monkeypatch.undo()

    def full(*a: object, **k: object) -> None:
        raise OSError(28, "No space left on device", str(tmp_path / "w"))

    monkeypatch.setattr(export, "write_export", full)
    assert export.main(["--load", str(ck), "--ckpt-step", step, "--output",
                        str(tmp_path / "w"), "--no-verify"]) == 2
    assert "No space left on device" in _one_error(capsys, "hla-sp export")


def test_eval_plans_its_memory_and_refuses_what_will_not_fit(
    diverged: tuple, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Probe 8: 8M tokens under a capped address space ended in an allocation traceback."""
    from hla_sp.launch.eval import command as evaluate
    from hla_sp.launch.eval import memory as eval_memory

    ck, _, _ = diverged
    step = str(checkpoint.complete_iterations(str(ck))[0])
    monkeypatch.setattr(eval_memory, "_address_space_left", lambda: 6 * eval_memory.GIB)
    started: list[object] = []
    argv = ["--load", str(ck), "--ckpt-step", step, "--task", "passkey", "--lengths", "64k,8M",
            "--samples", "1", "--depths", "0.5", "--output", str(tmp_path / "ev")]
    assert evaluate.main(argv, lambda *a, **k: started.append(a) or []) == 2
    line = _one_error(capsys, "hla-sp eval")
    assert line.startswith("hla-sp eval: error: --lengths: the longest, 8,388,608 tokens, "
                           "needs about "), line
    assert "6.0 GiB of address space" in line and "lengths up to 65,536 tokens" in line
    assert not started


def test_fp16_all_inf_weights_are_recorded_non_finite(tmp_path: Path) -> None:
    """Probe 2: the check read only the fp32 masters, finite while the fp16 weights were
    all inf; --keep-last kept it as "the last finite one"."""
    ck = tmp_path / "ck"
    records, err = _train(["--save", str(ck), "--train-iters", "4", "--fp16", "--loss-scale",
                           "1", "--lr", "1e5", "--min-lr", "0", "--save-interval", "1"])
    assert err is not None and records, (err, records)
    it = records[-1]["iteration"]
    assert manifest.is_finite(checkpoint.iter_dir(str(ck), it)) is False
    assert "no checkpoint whose forward is finite" in str(err) and "--lr" in str(err)
    assert checkpoint.newest_finite(str(ck)) is None


def test_the_finite_check_covers_weights_at_their_dtype_masters_and_optimizer() -> None:
    from hla_sp.launch.train.nonfinite import checkpoint_finite, saved_tensors

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    ok = {"loss": 1.0, "grad_norm": 1.0}
    assert checkpoint_finite(saved_tensors(model, [], opt), ok)
    next(iter(opt.state.values()))["exp_avg_sq"][0, 0] = float("inf")
    assert not checkpoint_finite(saved_tensors(model, [], opt), ok)
    half = torch.nn.Linear(4, 4).half()
    with torch.no_grad():
        half.weight.fill_(float("inf"))
    masters = [p.detach().float().clamp(-1, 1) for p in half.parameters()]
    assert not checkpoint_finite(saved_tensors(half, masters, torch.optim.AdamW(masters)), ok)


def test_without_the_check_the_run_trains_on_with_no_traceback(tmp_path: Path) -> None:
    """Probe 10: --no-check-for-nan-in-loss-and-grad crashed two steps later with a
    126-line traceback (log_decay ... got max nan)."""
    ck = tmp_path / "ck"
    records, err = _train(["--save", str(ck), *DIVERGE[:-4], "--train-iters", "10",
                           "--save-interval", "5", "--no-check-for-nan-in-loss-and-grad"])
    assert err is None, err
    assert len(records) == 10 and any(r.get("skipped") for r in records), records
    assert all(not math.isfinite(r["loss"]) or not math.isfinite(r["grad_norm"])
               for r in records if r.get("skipped"))
    # saved as they went: finite exactly where the iteration's loss was (the weights
    # stayed finite, but a skipped step's weights gave its non-finite loss)
    assert checkpoint.complete_iterations(str(ck)) == [5, 10]
    assert [manifest.is_finite(checkpoint.iter_dir(str(ck), it)) for it in (5, 10)] == [
        math.isfinite(records[it - 1]["loss"]) for it in (5, 10)]
    assert not (ck / checkpoint.LOCK).exists()

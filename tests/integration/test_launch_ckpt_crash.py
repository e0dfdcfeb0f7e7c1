"""Checkpoints that survive every crash, and resumes that say what they do: a re-saved
iteration is swapped in by rename, ``latest`` falls back to the newest complete
checkpoint, --save is checked before training, a changed schedule is refused unless
Megatron's two flags say whose to trust, a malformed config.json is one line naming the
key, --keep-last, and a survivor says "while saving iteration N"."""

from __future__ import annotations

import builtins
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_flags
from hla_sp.launch import checkpoint
from hla_sp.launch.checks import validate
from hla_sp.launch.config.train_config import ConfigError, parse_args
from hla_sp.launch.distributed import faults
from hla_sp.launch.distributed.local import run_local

TINY = tiny_flags(1, 32, "--lr", "3e-3", "--seed", "7")



def _parts(fill: float = 0.0) -> dict:
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(fill)
    opt = torch.optim.AdamW(model.parameters())
    return dict(model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))


def _save(root: Path, it: int, fill: float = 0.0, config: dict | None = None, **kw: object) -> str:
    return checkpoint.save(str(root), it, rank=0, world_size=1, tp_rank=0, writes_model=True,
                           consumed_samples=it, config=config or {}, **_parts(fill),
                           **kw)  # type: ignore[arg-type]  # fmt: skip


def _load(root: Path, step: int | None = None) -> tuple[dict, torch.nn.Module]:
    parts = _parts(-1.0)
    pos = checkpoint.load(str(root), rank=0, world_size=1, tp_rank=0, step=step, **parts)
    return pos, parts["model"]


# --- the swap -----------------------------------------------------------------------


def test_resave_swaps_by_rename_and_never_deletes_first(
    tmp_path: Path, group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "c"
    _save(root, 2, fill=1.0)
    removed: list[tuple[str, bool]] = []
    real = shutil.rmtree

    def spy(path: str, *a: object, **k: object) -> None:
        # when anything named iter_0000002* is deleted, the new copy must be in place
        if "iter_0000002" in str(path):
            removed.append((str(path), checkpoint.is_complete(str(root / "iter_0000002"))))
        real(path, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(checkpoint.shutil, "rmtree", spy)
    _save(root, 2, fill=2.0)
    assert removed and all(in_place for _, in_place in removed), removed
    assert all(p.endswith(".old") for p, _ in removed)
    pos, model = _load(root)
    assert pos["iteration"] == 2 and float(model.weight[0, 0]) == 2.0
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", checkpoint.LATEST]


def test_crash_inside_the_swap_keeps_the_old_copy(
    tmp_path: Path, group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed between moving the old copy aside and renaming the new one in: `latest`
    names a directory that is not there, yet the resume finds the old copy, and the
    next save puts it back before anything else."""
    root = tmp_path / "c"
    _save(root, 1, fill=1.0)
    _save(root, 2, fill=2.0)
    real = os.replace

    def crash(src: str, dst: str) -> None:
        if str(src).endswith("iter_0000002.tmp"):
            raise OSError("simulated crash inside the swap")
        real(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="inside the swap"):
        _save(root, 2, fill=3.0)
    monkeypatch.setattr(os, "replace", real)
    assert not (root / "iter_0000002").exists() and (root / "iter_0000002.old").is_dir()
    assert checkpoint.latest_iteration(str(root)) == 2
    pos, model = _load(root)
    assert pos["iteration"] == 2 and float(model.weight[0, 0]) == 2.0
    validate(parse_args([*TINY, "--load", str(root)]), 1)  # the trainer's check agrees
    _save(root, 3)
    assert sorted(p.name for p in root.iterdir()) == [
        "iter_0000001", "iter_0000002", "iter_0000003", checkpoint.LATEST]


# --- latest falls back ------------------------------------------------------------


def test_latest_falls_back_to_the_newest_complete_checkpoint(
    tmp_path: Path, group: None, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(checkpoint.layout, "_warned", set())
    root = tmp_path / "c"
    for it in (1, 2, 3):
        _save(root, it, fill=float(it))
    shutil.rmtree(root / "iter_0000003")  # latest names a directory that is gone
    assert checkpoint.latest_iteration(str(root)) == 2
    assert checkpoint.latest_iteration(str(root)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"[hla-sp] warning: {root}: {checkpoint.LATEST} names iteration 3, whose "
                   f"iter_0000003 is missing or incomplete; using iteration 2, the newest "
                   f"complete checkpoint"], err  # one line, once
    pos, model = _load(root)
    assert pos["iteration"] == 2 and float(model.weight[0, 0]) == 2.0
    # an incomplete directory (emptied by hand) is no checkpoint either
    (root / "iter_0000002" / checkpoint.SHARDED / ".metadata").unlink()
    assert checkpoint.latest_iteration(str(root)) == 1
    # garbage in latest, and no latest at all, fall back the same way
    (root / checkpoint.LATEST).write_bytes(b"\x00junk")
    assert checkpoint.latest_iteration(str(root)) == 1
    (root / checkpoint.LATEST).unlink()
    assert checkpoint.latest_iteration(str(root)) == 1
    assert "unreadable" in capsys.readouterr().err


def test_latest_naming_nothing_with_nothing_to_fall_back_to_is_an_error(
    tmp_path: Path,
) -> None:
    root = tmp_path / "c"
    root.mkdir()
    (root / checkpoint.LATEST).write_text("5\n")
    with pytest.raises(checkpoint.CheckpointError, match="names iteration 5, but"):
        checkpoint.latest_iteration(str(root))
    with pytest.raises(ConfigError, match="no other complete checkpoint"):
        validate(parse_args([*TINY, "--load", str(root)]), 1)


# --- --save checked before training -----------------------------------------------


def test_save_holding_another_runs_checkpoints_is_refused(tmp_path: Path, group: None) -> None:
    old = tmp_path / "run1"
    for it in (25, 50):
        _save(old, it)
    with pytest.raises(ConfigError) as e:
        checkpoint.preflight(parse_args([*TINY, "--save", str(old)]))
    assert str(e.value) == (f"--save {old}: holds another run's checkpoints (iterations "
                            f"25..50); pass --load {old} to resume that run, or --save a new "
                            f"directory")
    with pytest.raises(ConfigError, match="another run's"):
        checkpoint.preflight(parse_args([*TINY, "--save", str(old), "--load",
                                         str(tmp_path / "other")]))
    checkpoint.preflight(parse_args([*TINY, "--save", str(old), "--load", str(old),
                                     "--train-iters", "50"]))
    checkpoint.preflight(parse_args([*TINY, "--save", str(tmp_path / "new")]))


def test_symlinked_iter_under_save_is_refused(tmp_path: Path) -> None:
    save = tmp_path / "s"
    save.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (save / "iter_0000005.tmp").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError) as e:
        checkpoint.preflight(parse_args([*TINY, "--save", str(save)]))
    assert f"--save {save}: iter_0000005.tmp is a symbolic link (to {tmp_path / 'elsewhere'})" \
        in str(e.value)


def test_unwritable_save_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = builtins.open

    def deny(path: object, *a: object, **k: object) -> object:
        if ".hla_sp_write_probe" in str(path):
            raise PermissionError(13, "Permission denied")
        return real(path, *a, **k)  # type: ignore[call-overload]

    monkeypatch.setattr(builtins, "open", deny)
    with pytest.raises(ConfigError) as e:
        checkpoint.preflight(parse_args([*TINY, "--save", str(tmp_path / "a" / "b")]))
    assert str(e.value).startswith(f"--save {tmp_path / 'a' / 'b'}: expected a writable "
                                   f"directory, but {tmp_path} is not writable")


def test_free_space_for_one_checkpoint_with_the_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = parse_args([*TINY, "--save", str(tmp_path / "s")])
    need = checkpoint.estimate_checkpoint_bytes(cfg)
    usage = shutil.disk_usage(tmp_path)._replace(free=need // 2)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage)
    with pytest.raises(ConfigError) as e:
        checkpoint.preflight(cfg)
    assert "one checkpoint needs about" in str(e.value) and f"{need:,} bytes" in str(e.value)
    assert "estimated from the model" in str(e.value)


def test_keep_last_flag_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--keep-last: expected an integer >= 1, got 0"):
        checkpoint.preflight(parse_args([*TINY, "--save", str(tmp_path), "--keep-last", "0"]))
    with pytest.raises(ConfigError, match="goes with --save DIR"):
        checkpoint.preflight(parse_args([*TINY, "--keep-last", "2"]))


# --- --keep-last ----------------------------------------------------------------------


def test_keep_last_keeps_the_newest(tmp_path: Path, group: None,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "c"
    for it in range(1, 6):
        _save(root, it, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == [
        "iter_0000004", "iter_0000005", checkpoint.LATEST]
    # a crash mid-delete leaves a renamed, never a partial, checkpoint; the next save
    # removes it
    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda *a, **k: None)
    _save(root, 6, keep_last=2)
    assert checkpoint.complete_iterations(str(root)) == [5, 6]
    assert (root / "iter_0000004.del").is_dir()
    monkeypatch.undo()
    _save(root, 7, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == [
        "iter_0000006", "iter_0000007", checkpoint.LATEST]


def test_keep_last_leaves_later_iterations_of_an_earlier_resume(
    tmp_path: Path, group: None
) -> None:
    root = tmp_path / "c"
    for it in (2, 4, 8):
        _save(root, it)
    _save(root, 5, keep_last=1)  # resumed from --ckpt-step 4: 8 is not older
    assert checkpoint.complete_iterations(str(root)) == [5, 8]


# --- the schedule on resume ---------------------------------------------------------


@pytest.fixture
def six(tmp_path: Path, group: None) -> Path:
    """A checkpoint at iteration 6 of a --train-iters 6 run."""
    root = tmp_path / "c"
    _save(root, 6, config=parse_args([*TINY, "--train-iters", "6"]).to_dict())
    return root


@pytest.mark.parametrize(("flags", "diff"), [
    (["--train-iters", "8"], "--train-iters 6 (checkpoint) != 8 (this run), the decay length"),
    (["--train-iters", "6", "--lr", "1e-3"], "--lr 0.003 (checkpoint) != 0.001 (this run)"),
    (["--train-iters", "6", "--min-lr", "0"], "--min-lr 0.0001 (checkpoint) != 0.0 (this run)"),
    (["--train-iters", "6", "--lr-decay-style", "linear"],
     "--lr-decay-style cosine (checkpoint) != linear (this run)"),
])  # fmt: skip
def test_changed_schedule_refused_with_the_diff(six: Path, flags: list[str], diff: str) -> None:
    cfg = parse_args([*TINY, "--load", str(six), *flags])
    with pytest.raises(ConfigError) as e:
        checkpoint.preflight(cfg)
    msg = str(e.value)
    assert "\n" not in msg and diff in msg and "--use-checkpoint-opt_param-scheduler" in msg
    for flag in ("--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler",
                 "--override-opt-param-scheduler"):
        checkpoint.preflight(parse_args([*TINY, "--load", str(six), *flags, flag]))
    with pytest.raises(ConfigError, match="exclude each other"):
        checkpoint.preflight(parse_args([*TINY, "--load", str(six), *flags,
                                         "--override-opt_param-scheduler",
                                         "--use-checkpoint-opt_param-scheduler"]))


def test_unchanged_schedule_and_explicit_decay_length_pass(six: Path) -> None:
    checkpoint.preflight(parse_args([*TINY, "--load", str(six), "--train-iters", "6"]))
    root = six.parent / "d"
    _save(root, 4, config=parse_args([*TINY, "--train-iters", "6",
                                      "--lr-decay-iters", "10"]).to_dict())
    # a longer run with the same decay length keeps the same schedule
    checkpoint.preflight(parse_args([*TINY, "--load", str(root), "--train-iters", "9",
                                     "--lr-decay-iters", "10"]))


@pytest.fixture(scope="module")
def schedule_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """4 iterations of a --train-iters 4 run, then on to 6 under each of the two flags."""
    from hla_sp.launch.train.main import run

    d = tmp_path_factory.mktemp("sched")
    base = [*TINY, "--min-lr", "1e-5", "--micro-batch-size", "2"]
    run(parse_args([*base, "--train-iters", "4", "--save", str(d / "a")]), exit_on_error=False)
    shutil.copytree(d / "a", d / "b")
    out = {}
    for name, flag in (("a", "--use-checkpoint-opt_param-scheduler"),
                       ("b", "--override-opt_param-scheduler")):
        out[name] = run(parse_args([*base, "--train-iters", "6", "--load", str(d / name),
                                    "--save", str(d / name), flag]), exit_on_error=False)
    out["dir"] = d
    out["cfg"] = parse_args([*base, "--train-iters", "4"])
    return out


def test_the_flags_do_what_megatron_does(schedule_runs: dict[str, Any]) -> None:
    kept, new = schedule_runs["a"], schedule_runs["b"]
    assert [r["iteration"] for r in kept] == [r["iteration"] for r in new] == [5, 6]
    # the checkpoint's decay length (4) is over: the rate sits at --min-lr
    assert [r["lr"] for r in kept] == pytest.approx([1e-5, 1e-5])
    # this run's decay length (6): iteration 5 is at step 4 of 6 of the cosine
    import math

    want = 1e-5 + (3e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi * 4 / 6))
    assert new[0]["lr"] == pytest.approx(want, rel=1e-6)


# --- config.json ----------------------------------------------------------------------


@pytest.mark.parametrize(("text", "needle"), [
    ('{"hla": "x"}', "key 'hla': expected an object, got 'x'"),
    ('{"hidden_size": "64"}', "key 'hidden_size': expected an integer, got '64'"),
    ('{"num_layers": true}', "key 'num_layers': expected an integer, got True"),
    ('{"bf16": 1}', "key 'bf16': expected true or false, got 1"),
    ('{"data_path": [1]}', "key 'data_path': expected a list of strings"),
    ('{"hla": {"attention": {"a": 1}}}', "key 'hla': expected an object of plain values"),
    ('{"lr": null}', "key 'lr': expected a number, got None"),
    ('{"hla": ' + "[" * 100_000 + "]" * 100_000 + "}", "key 'hla' nests more than 32 levels"),
    ("[" * 100_000, "the top level nests more than 32 levels"),
    ("[1, 2]", "expected a JSON object of flags, got list"),
    ('{"lr": 1e-3,', "not valid JSON"),
])  # fmt: skip
def test_malformed_config_json_is_one_line_naming_the_key(
    tmp_path: Path, group: None, text: str, needle: str
) -> None:
    root = tmp_path / "c"
    d = _save(root, 3)
    (Path(d) / "config.json").write_text(text)
    with pytest.raises(ConfigError) as e:
        validate(parse_args([*TINY, "--load", str(root)]), 1)
    msg = str(e.value)
    assert "\n" not in msg and needle in msg and str(Path(d) / "config.json") in msg, msg
    assert len(msg) < 400


def test_well_formed_config_json_round_trips(tmp_path: Path, group: None) -> None:
    cfg = parse_args([*TINY, "--data-path", "0.5", "a", "0.5", "b"])
    d = _save(tmp_path / "c", 1, config=cfg.to_dict())
    assert checkpoint.saved_config(str(tmp_path / "c"), 1) == json.loads(
        (Path(d) / "config.json").read_text())


# --- "while saving iteration N" --------------------------------------------------------


def test_failure_during_a_save_says_so(capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "_store", lambda: None)
    monkeypatch.setattr(faults, "_progress", (4, faults.time.monotonic() - 0.2))
    with faults.saving(4):
        faults.report_failure(0, 2, ValueError("boom"))
    first = capsys.readouterr().err.splitlines()[0]
    assert first.endswith("(while saving iteration 4)")
    # as the trainer sees it: the error has left the save when the report is written
    with pytest.raises(ValueError) as e, faults.saving(4):
        raise ValueError("boom")
    assert faults._saving is None
    faults.report_failure(0, 2, e.value)
    first = capsys.readouterr().err.splitlines()[0]
    assert first == "[hla-sp] rank 0/2: training stopped by ValueError: boom (while saving " \
                    "iteration 4)"
    faults.report_failure(0, 2, ValueError("boom"))
    assert "(0." in capsys.readouterr().err  # outside a save: time into the next iteration


def test_peer_killed_during_a_save_is_reported_as_such(tmp_path: Path) -> None:
    run = run_local(
        [*TINY, "--train-iters", "6", "--context-parallel-size", "2", "--save",
         str(tmp_path / "ck"), "--save-interval", "2", "--distributed-timeout-minutes", "5"],
        2, str(tmp_path / "m.jsonl"), env={"HLA_SP_FAULT": "1:2:kill@save"}, timeout=240,
    )  # fmt: skip
    assert run.returncode != 0
    assert [r["iteration"] for r in run.records] == [1, 2]
    line = next((x for x in run.output.splitlines() if "rank 0/2: training stopped by" in x), "")
    assert line.endswith("(while saving iteration 2)"), run.output[-3000:]
    assert "1 (last finished iteration 2, while saving iteration 2) stopped responding" \
        in run.output, run.output[-3000:]
    # the interrupted save left no checkpoint under a checkpoint's name
    assert checkpoint.complete_iterations(str(tmp_path / "ck")) == []


def test_the_free_space_estimate_is_the_real_size(schedule_runs: dict[str, Any]) -> None:
    real = checkpoint.dir_bytes(checkpoint.iter_dir(str(schedule_runs["dir"] / "a"), 6))
    est = checkpoint.estimate_checkpoint_bytes(schedule_runs["cfg"])
    assert 0.8 < est / real < 1.1, (est, real)

"""--load as Megatron reads it, mixed precision, validation, start markers and the plot."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_flags
from hla_sp.launch import checkpoint
from hla_sp.launch.checks import validate
from hla_sp.launch.config.train_config import ConfigError, parse_args
from hla_sp.launch.distributed.local import read_jsonl, torchrun_argv, worker_env
from hla_sp.launch.train.main import run
from hla_sp.launch.train.precision import LossScaler

TINY = tiny_flags(2, 64, "--lr", "3e-3", "--seed", "7", "--micro-batch-size", "2")


def _launch(flags: list[str], nproc: int = 2) -> subprocess.CompletedProcess:
    """torchrun with the JSONL left in place (re-runs append to it)."""
    return subprocess.run(torchrun_argv(nproc, flags), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600, env=worker_env(None))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """bf16 at CP=2 with validation into an empty --load dir; again (nothing to do);
    then two more iterations from the checkpoint, into the same JSONL."""
    d = tmp_path_factory.mktemp("resume")
    ck, log = d / "ck", d / "m.jsonl"
    ck.mkdir()  # empty: Megatron starts fresh, and so must we
    base = [*TINY, "--context-parallel-size", "2", "--bf16", "--eval-interval", "3",
            "--eval-iters", "1", "--save", str(ck), "--load", str(ck), "--log-jsonl", str(log)]
    first = _launch([*base, "--train-iters", "6"])
    again = _launch([*base, "--train-iters", "6"])
    # a longer run changes the decay length (--train-iters): Megatron's flag says to keep
    # the checkpoint's schedule (without it the resume is refused with the difference)
    more = _launch([*base, "--train-iters", "8", "--use-checkpoint-opt_param-scheduler"])
    return {"first": first, "again": again, "more": more, "ck": ck, "log": log}


def test_empty_load_dir_starts_fresh_in_one_line(resumed: dict) -> None:
    out = resumed["first"].stdout
    assert resumed["first"].returncode == 0, out[-4000:]
    assert f"--load {resumed['ck']}: no checkpoint there, starting from iteration 0" in out
    assert "Traceback" not in out


def test_finished_run_says_nothing_to_do(resumed: dict) -> None:
    p = resumed["again"]
    assert p.returncode == 0, p.stdout[-4000:]
    assert "nothing to do: the checkpoint in" in p.stdout and "iteration 6" in p.stdout
    assert "iter " not in p.stdout


def test_jsonl_marks_each_run_and_carries_validation(resumed: dict) -> None:
    assert resumed["more"].returncode == 0, resumed["more"].stdout[-4000:]
    rows = read_jsonl(str(resumed["log"]), events=True)
    starts = [r for r in rows if r.get("event") == "start"]
    assert [(s["iteration"], s["resumed_from"]) for s in starts] == [(0, None), (6, 6)]
    recs = read_jsonl(str(resumed["log"]))
    assert [r["iteration"] for r in recs] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [r["iteration"] for r in recs if "val_loss" in r] == [3, 6, 8]
    assert all(math.isfinite(r["val_loss"]) for r in recs if "val_loss" in r)
    png = resumed["log"].with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bf16_checkpoint_keeps_fp32_master_weights(resumed: dict, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint.iter_dir(str(resumed["ck"]), 8) + "/" + checkpoint.SHARDED,
                      str(tmp_path / "whole.pt"))  # fmt: skip
    state = torch.load(tmp_path / "whole.pt", weights_only=True)
    halves = [v for k, v in state.items() if not k.startswith("optimizer.")]
    masters = [v for k, v in state.items() if k.startswith("optimizer.state.fp32_param.")]
    assert halves and all(v.dtype == torch.bfloat16 for v in halves)
    assert masters and all(m.dtype == torch.float32 for m in masters)


def test_other_model_refused_before_any_process_group(
    resumed: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_group(*a: object, **k: object) -> None:
        raise AssertionError("a process group was created before the checkpoint was compared")

    monkeypatch.setattr(dist, "init_process_group", no_group)
    monkeypatch.setenv("WORLD_SIZE", "2")
    flags = [*TINY, "--context-parallel-size", "2", "--bf16", "--load", str(resumed["ck"]),
             "--hidden-size", "64", "--train-iters", "9"]
    with pytest.raises(ConfigError) as e:
        run(parse_args(flags))
    msg = str(e.value)
    assert "\n" not in msg and "--hidden-size 32 (checkpoint) != 64 (this run)" in msg
    # flags that change no parameter may differ
    ok = [*TINY, "--context-parallel-size", "2", "--bf16", "--load", str(resumed["ck"]),
          "--hla-chunk-size", "32", "--train-iters", "9"]
    validate(parse_args(ok), 2)


def test_missing_load_dir_is_a_fresh_start_not_an_error(tmp_path: Path) -> None:
    validate(parse_args([*TINY, "--load", str(tmp_path / "none")]), 1)
    with pytest.raises(ConfigError, match="--ckpt-step 3: no such directory"):
        validate(parse_args([*TINY, "--load", str(tmp_path / "none"), "--ckpt-step", "3"]), 1)


@pytest.fixture(scope="module")
def precision_runs() -> dict[str, list[dict]]:
    """One process each (in this one): fp32, bf16, fp16 with a static and a dynamic scale."""
    out = {}
    for name, extra in (("fp32", []), ("bf16", ["--bf16"]),
                        ("fp16", ["--fp16", "--loss-scale", "1024"]), ("fp16dyn", ["--fp16"])):
        out[name] = run(parse_args([*TINY, "--train-iters", "8", *extra]), exit_on_error=False)
    return out


def test_bf16_on_cpu_trains_like_fp32(precision_runs: dict) -> None:
    f32 = [r["loss"] for r in precision_runs["fp32"]]
    b16 = [r["loss"] for r in precision_runs["bf16"]]
    # the same data and initial weights (rounded to bf16): the losses agree to bf16's
    # resolution and drift apart slowly; an error in the master-weight path shows at once
    assert abs(b16[0] - f32[0]) < 0.02, (b16, f32)
    assert max(abs(a - b) for a, b in zip(b16, f32)) < 0.1, (b16, f32)
    assert b16[-1] < b16[0] - 0.1  # and it learns


def test_fp16_static_scale_trains_and_dynamic_scale_backs_off(precision_runs: dict) -> None:
    f32 = [r["loss"] for r in precision_runs["fp32"]]
    f16 = precision_runs["fp16"]
    assert not any(r["skipped"] for r in f16) and {r["loss_scale"] for r in f16} == {1024.0}
    assert max(abs(r["loss"] - a) for r, a in zip(f16, f32)) < 0.1
    dyn = precision_runs["fp16dyn"]
    # 2^32 overflows fp16: Megatron's scaler skips (hysteresis 2), then halves each step
    assert dyn[0]["skipped"] and dyn[0]["loss_scale"] == 2.0**32
    assert [r["loss_scale"] for r in dyn[:4]] == [2.0**32, 2.0**32, 2.0**31, 2.0**30]


def test_loss_scaler_grows_after_a_clean_window() -> None:
    s = LossScaler(None, initial=8.0, window=3, hysteresis=2)
    for _ in range(3):
        s.update(False)
    assert s.scale == 16.0
    s.update(True)
    assert s.scale == 16.0  # hysteresis: the first overflow is tolerated
    s.update(True)
    assert s.scale == 8.0
    static = LossScaler(128.0)
    static.update(True)
    assert static.scale == 128.0


def test_rope_refused_on_cpu_and_accepted_with_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from hla_sp.launch import checks

    cfg = parse_args([*TINY, "--position-embedding-type", "rope"])
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="rope: megatron-core's rotary embedding runs on"):
            validate(cfg, 1)
    monkeypatch.setattr(checks, "_cuda_available", lambda: True)
    validate(cfg, 1)


def test_split_holds_out_validation_windows() -> None:
    from hla_sp.launch.data.datasets import split_windows

    train, valid = split_windows(1000, (0.969, 0.03, 0.001))
    assert (train, valid) == (range(0, 969), range(969, 999))
    train, valid = split_windows(8, (0.969, 0.03, 0.001))  # a few long samples
    assert len(valid) == 1 and train.stop == valid.start and len(train) == 7


def test_checkpoint_config_json_is_what_load_compares(resumed: dict) -> None:
    saved = json.loads((Path(checkpoint.iter_dir(str(resumed["ck"]), 8)) / "config.json")
                       .read_text())
    assert saved["model"]["hidden_size"] == 32 and saved["precision"]["bf16"] is True

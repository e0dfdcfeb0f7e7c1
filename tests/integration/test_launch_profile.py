"""--profile (Megatron's --profile-step-start/--profile-step-end/--profile-ranks): one
Chrome trace per profiled rank holding exactly the profiled steps, with the HLA
operator's events in them; bad values refused at check time, in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_flags
from hla_sp.launch.checks import validate
from hla_sp.launch.config.train_config import ConfigError, parse_args
from hla_sp.launch.distributed.local import run_local

TINY = tiny_flags(2, 64, "--train-iters", "4", "--lr", "3e-3", "--seed", "7",
    "--micro-batch-size", "2")


@pytest.mark.parametrize(
    ("argv", "world", "needle"),
    [
        ("--profile --profile-step-start 3 --profile-step-end 3", 1,
         "--profile-step-end: expected > --profile-step-start 3, got 3"),
        ("--profile --profile-step-start 2 --profile-step-end 21", 1,
         "--profile-step-end: expected <= --train-iters 20 (steps are counted from 0), got 21"),
        ("--profile --profile-step-start -1 --profile-step-end 2", 1,
         "--profile-step-start: expected a finite value in [0, inf], got -1"),
        ("--profile --profile-ranks 0 2 --profile-step-start 1 --profile-step-end 2", 2,
         "--profile-ranks: expected ranks in [0, 1] (world size 2), got [0, 2]"),
        ("--profile --profile-step-start 1 --profile-step-end 2", 1,
         "--profile: expected --tensorboard-dir or --save to hold the traces"),
    ],
)  # fmt: skip
def test_bad_profile_flags_are_refused_in_one_line(argv: str, world: int, needle: str,
                                                   tmp_path: Path) -> None:
    args = argv.split() + ([] if "hold the traces" in needle else ["--save", str(tmp_path)])
    with pytest.raises(ConfigError) as e:
        validate(parse_args(args, raise_errors=True), world)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_profile_flags_are_ignored_without_profile() -> None:
    validate(parse_args(["--profile-step-start", "5", "--profile-step-end", "2"]), 1)


def _spans(events: list[dict], prefix: str) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith(prefix)]


def test_profile_writes_one_trace_per_rank_with_exactly_the_steps(tmp_path: Path) -> None:
    """CP 2, both ranks profiled, steps 1 and 2 of 0-3: step 0 is the warm-up and is not
    in the trace, nor is step 3; every profiled step runs the HLA operator."""
    run = run_local([*TINY, "--context-parallel-size", "2", "--save", str(tmp_path / "ck"),
                     "--profile", "--profile-step-start", "1", "--profile-step-end", "3",
                     "--profile-ranks", "0", "1"], 2, str(tmp_path / "m.jsonl"), timeout=300)
    assert run.returncode == 0, run.output[-4000:]
    assert len(run.records) == 4
    for rank in (0, 1):
        path = tmp_path / "ck" / "profile" / f"rank{rank}.steps1-3.pt.trace.json"
        assert str(path) in run.output
        events = json.loads(path.read_text())["traceEvents"]
        steps = _spans(events, "ProfilerStep#")
        assert sorted(s["name"] for s in steps) == ["ProfilerStep#1", "ProfilerStep#2"]
        hla = _spans(events, "hla_sp::hla2")
        # each layer's HLA core attention (2 layers, one microbatch) inside each step
        assert len(hla) == 2 * len(steps), sorted({e["name"] for e in hla})
        for s in steps:
            inside = [e for e in hla if s["ts"] <= e["ts"] <= s["ts"] + s["dur"]]
            assert len(inside) == 2, (s["name"], len(inside))

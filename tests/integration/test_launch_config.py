"""Trainer flags: help from field docstrings, and bad flags rejected before any process group."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist
from hla_sp.launch.checks import validate
from hla_sp.launch.config.train_config import ConfigError, build_parser, parse_args

HLA_SP = os.path.join(os.path.dirname(sys.executable), "hla-sp")


def test_help_comes_from_field_docstrings() -> None:
    text = build_parser().format_help()
    assert "2 x context-parallel-size" in text  # --seq-length's docstring
    assert "--context-parallel-size" in text and "--hla-decay" in text


def test_megatron_spellings_parse() -> None:
    argv = (
        "--num-layers 3 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2 "
        "--seq-length 128 --micro-batch-size 2 --global-batch-size 4 --train-iters 7 --lr 3e-4 "
        "--lr-warmup-iters 2 --min-lr 1e-5 --clip-grad 0.5 --seed 9 --context-parallel-size 2 "
        "--tensor-model-parallel-size 1 --recompute-activations --attention ahla"
    )
    cfg = parse_args(argv.split(" "))
    m = cfg.model
    assert (m.num_layers, m.num_query_groups, cfg.optimizer.global_batch_size) == (3, 2, 4)
    assert cfg.model.recompute_activations and cfg.model.attention == "ahla"
    assert cfg.hla.decay  # HLA flags came from megatron_patch.add_hla_args


@pytest.mark.parametrize(
    ("argv", "world", "needle"),
    [
        ("--seq-length 130 --context-parallel-size 2", 2, "--seq-length 128 or 132"),
        ("--context-parallel-size 3", 4, "does not divide the world size 4"),
        ("--data-path /nonexistent/corpus", 1, "/nonexistent/corpus.bin not found"),
        ("--hidden-size 30 --num-attention-heads 4", 1, "not divisible by --num-attention-heads"),
        ("--global-batch-size 3 --micro-batch-size 2", 2, "multiple of --micro-batch-size"),
        ("--load /nonexistent/ckpt --ckpt-step 3", 1, "--ckpt-step 3: no such directory"),
        ("--bf16 --fp16", 1, "--bf16 and --fp16 exclude each other"),
        ("--split 1,x", 1, "--split: expected up to three weights"),
        (
            "--data synthetic-recall --recall-pairs 8 --seq-length 64 --context-parallel-size 4",
            4,
            "use --seq-length >= 128",
        ),
    ],
)
def test_bad_flags_rejected_before_any_process_group(
    argv: str, world: int, needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hla_sp.launch.train import main as train

    def no_group(*a: object, **k: object) -> None:
        raise AssertionError("a process group was created before the flags were checked")

    monkeypatch.setattr(dist, "init_process_group", no_group)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = parse_args(argv.split())
    with pytest.raises(ConfigError) as e:
        train.run(cfg)
    assert needle in str(e.value)
    with pytest.raises(ConfigError):
        validate(cfg, world)


def test_cli_rejects_before_starting_torchrun() -> None:
    p = subprocess.run(
        [HLA_SP, "train", "--nproc-per-node", "4", "--context-parallel-size", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert "does not divide the world size 4" in p.stderr
    assert "torch.distributed" not in p.stderr  # torchrun never started


def test_cli_builds_multinode_torchrun_command() -> None:
    p = subprocess.run(
        [HLA_SP, "train", "--nproc-per-node", "2", "--nnodes", "2", "--rdzv-endpoint",
         "node0:29400", "--dry-run", "--context-parallel-size", "4", "--seq-length", "64"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "--nnodes 2 --rdzv-backend c10d --rdzv-endpoint node0:29400" in p.stdout
    assert p.stdout.rstrip().endswith(
        "-m hla_sp.launch.train --context-parallel-size 4 --seq-length 64"
    )

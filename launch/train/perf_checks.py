"""The checks of --compile and --profile against the other sections and the world size,
and where --profile's traces go (see :mod:`hla_sp.launch.config.sections_perf`)."""

from __future__ import annotations

import os
import typing

from hla_sp.launch.errors import ConfigError

if typing.TYPE_CHECKING:
    from hla_sp.launch.config.train_config import TrainConfig

__all__ = ["check_performance", "profile_dir"]


def profile_dir(cfg: TrainConfig) -> str | None:
    """Where --profile writes its traces: <--tensorboard-dir, else --save>/profile."""
    base = cfg.logging.tensorboard_dir or cfg.checkpoint.save
    return os.path.join(base, "profile") if base else None


def check_performance(cfg: TrainConfig, world_size: int) -> None:
    """--compile against tensor parallelism; --profile's steps, ranks and directory."""
    perf = cfg.performance
    tp = cfg.parallelism.tensor_model_parallel_size
    if perf.compile and tp > 1:
        raise ConfigError(
            f"--compile: expected --tensor-model-parallel-size 1, got {tp} (megatron-core's "
            f"tensor-parallel linear all-reduces asynchronously in backward, which "
            f"torch.compile cannot trace whole)")
    if not perf.profile:
        return
    iters = cfg.optimizer.train_iters
    if perf.profile_step_end > iters:
        raise ConfigError(
            f"--profile-step-end: expected <= --train-iters {iters} (steps are counted from "
            f"0), got {perf.profile_step_end}")
    bad = [r for r in perf.ranks if not 0 <= r < world_size]
    if bad:
        raise ConfigError(
            f"--profile-ranks: expected ranks in [0, {world_size - 1}] (world size "
            f"{world_size}), got {perf.ranks}")
    if profile_dir(cfg) is None:
        raise ConfigError(
            "--profile: expected --tensorboard-dir or --save to hold the traces "
            "(<dir>/profile), got neither")

"""The trainer's flag checks: each section's own, then those across sections.

:func:`validate` checks a config against a world size *before* any process group
exists, so a bad flag costs a second, not a cluster allocation, and says what to change.
Each section checks what it shows alone (``validate``: ranges, choices, the schedule,
the position table, ...); the checks here need several sections, the world size, the
machine or the files: the parallel layout, TP's share of the heads, the batch, what
needs CUDA, the HLA flags with the layer count, the data, the checkpoint to resume, the
installed loggers, --compile and --profile. It runs its steps in a fixed order, so the
first problem reported stays the same.
"""

from __future__ import annotations

import os
import typing

from hla_sp.launch.checkpoint.resume_checks import check_load, check_skip_train
from hla_sp.launch.data.datasets import DatasetError, parse_data_path, recall_layout_error
from hla_sp.launch.data.indexed_dataset import check_indexed_dataset
from hla_sp.launch.data.tokenizer import check_data_tokenizer, check_run_tokenizer
from hla_sp.launch.errors import ConfigError
from hla_sp.launch.extras import installed
from hla_sp.megatron_patch.hybrid import check_trainer_hybrid

__all__ = ["check_performance", "profile_dir", "validate"]

if typing.TYPE_CHECKING:
    from hla_sp.launch.config.train_config import TrainConfig


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate(cfg: TrainConfig, world_size: int, *, offline: bool = False) -> None:
    """Reject configs that cannot run on ``world_size`` ranks; say what to change.

    Pure: touches no process group, so torchrun's workers (and ``hla-sp train``, before
    it starts torchrun) call it first. ``offline`` (``--dry-run``, planning a cluster
    job from a login node): the flags alone, with no data file, checkpoint or installed
    logger read, and what CUDA allows (RoPE) allowed on a machine without it.
    ``--tokenizer`` is loaded, and fills ``cfg.model.vocab_size`` when unset (its vocabulary).
    """
    _check_world_size(world_size)
    for _, section in cfg.sections():  # what each section shows alone, in --help's order
        section.validate()
    check_run_tokenizer(cfg)  # before the checks that read the vocabulary
    _check_parallel_layout(cfg, world_size)
    _check_heads_split(cfg)
    _check_batch(cfg, world_size)
    _check_device(cfg, offline)
    _check_attention(cfg)
    check_performance(cfg, world_size)  # --compile, --profile
    if offline:
        return
    _check_data(cfg)
    if cfg.checkpoint.load is not None:
        check_load(cfg)
    if cfg.evaluation.skip_train:
        check_skip_train(cfg)
    _check_loggers(cfg)


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(
            f"world size: expected >= 1 process (--nproc-per-node x --nnodes), got {world_size!r}"
        )


def _check_parallel_layout(cfg: TrainConfig, world_size: int) -> None:
    """CP x TP divides the world; the sequence splits into Megatron's 2 x CP chunks."""
    cp, tp = cfg.parallelism.context_parallel_size, cfg.parallelism.tensor_model_parallel_size
    seq = cfg.model.seq_length
    if world_size % (cp * tp):
        ok = [
            d for d in _divisors(world_size) if d * tp <= world_size and world_size % (d * tp) == 0
        ]
        raise ConfigError(
            f"--context-parallel-size {cp} x --tensor-model-parallel-size {tp} = {cp * tp} does "
            f"not divide the world size {world_size} (nproc-per-node x nnodes). Use a CP size "
            f"in {ok} with this TP size, or launch a multiple of {cp * tp} processes."
        )
    if cp > 1 and seq % (2 * cp):
        lo = seq // (2 * cp) * (2 * cp)
        raise ConfigError(
            f"--seq-length {seq} is not divisible by 2 x --context-parallel-size = "
            f"{2 * cp}, which Megatron's zigzag split needs (2 x CP equal chunks). Use "
            f"--seq-length {lo or 2 * cp} or {lo + 2 * cp}."
        )


def _check_heads_split(cfg: TrainConfig) -> None:
    """TP splits the heads and the query groups (the model checks they split each other)."""
    tp, m = cfg.parallelism.tensor_model_parallel_size, cfg.model
    if m.num_attention_heads % tp or m.query_groups % tp:
        raise ConfigError(
            f"--tensor-model-parallel-size {tp} must divide --num-attention-heads "
            f"{m.num_attention_heads} and --num-query-groups {m.query_groups}."
        )


def _check_batch(cfg: TrainConfig, world_size: int) -> None:
    """The global batch is a whole number of micro-batches on every data-parallel rank."""
    par, mbs = cfg.parallelism, cfg.optimizer.micro_batch_size
    dp = world_size // (par.context_parallel_size * par.tensor_model_parallel_size)
    gbs = cfg.optimizer.global_batch_size or mbs * dp
    if gbs % (mbs * dp):
        raise ConfigError(
            f"--global-batch-size {gbs} must be a multiple of --micro-batch-size "
            f"{mbs} x data-parallel size {dp} = {mbs * dp}."
        )


def _check_device(cfg: TrainConfig, offline: bool = False) -> None:
    """What needs CUDA (RoPE) on a machine without it, unless planning offline."""
    if cfg.model.position_embedding_type == "rope" and not offline and not _cuda_available():
        raise ConfigError(
            "--position-embedding-type rope: megatron-core's rotary embedding runs on the "
            "current CUDA device, and this machine has none; on CPU use learned_absolute "
            "(the default) or none."
        )


def _check_attention(cfg: TrainConfig) -> None:
    """--hla-layer-pattern with the layers, CP and the machine, and softmax's need for CUDA
    (the HLA options were checked when the config was made: TrainConfig.__post_init__)."""
    try:
        check_trainer_hybrid(cfg.hla_flags(), num_layers=cfg.model.num_layers,
                             context_parallel_size=cfg.parallelism.context_parallel_size,
                             cuda=_cuda_available())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.model.attention == "softmax" and not _cuda_available():
        raise ConfigError(
            "--attention softmax runs megatron-core's DotProductAttention, which needs CUDA; "
            "on CPU use --attention hla2 (or ahla, hla3)."
        )


def _check_data(cfg: TrainConfig) -> None:
    """--data-path names readable indexed datasets; the recall layout fits the CP split."""
    if cfg.data.data_path:

        try:  # Megatron's weighted form, 0.5 A 0.5 B, names the prefixes A and B
            prefixes = parse_data_path(cfg.data.data_path)[0]
        except DatasetError as e:
            raise ConfigError(str(e)) from None
        for prefix in prefixes:
            for ext in (".bin", ".idx"):
                if not os.path.isfile(prefix + ext):
                    raise ConfigError(
                        f"--data-path {prefix}: {prefix + ext} not found. Pass the prefix of a "
                        f"Megatron indexed dataset (without .bin/.idx), build one with "
                        f"`python -m hla_sp.launch.make_dataset --input FILES --output-prefix "
                        f"{prefix}`, or omit --data-path to train on the built-in text."
                    )
            try:
                check_indexed_dataset(prefix)
            except DatasetError as e:
                raise ConfigError(f"--data-path {prefix}: {e}") from None
            check_data_tokenizer(prefix, cfg)  # PREFIX.json of make-dataset, when there
    if cfg.data.data == "text":
        _check_samples(cfg)
    if cfg.data.data == "synthetic-recall":
        msg = recall_layout_error(cfg.model.seq_length, cfg.parallelism.context_parallel_size,
                                  cfg.data.recall_pairs)
        if msg:
            raise ConfigError(msg)


def _check_samples(cfg: TrainConfig) -> None:
    """The text data holds at least one sample of --seq-length in the training split,
    and in the validation split when it is read (--eval-interval, --skip-train): the
    sample sources the trainer builds, built here (opening an indexed dataset reads no
    tokens), so that a small file fails before any process starts."""
    from hla_sp.launch.data.datasets import DatasetError, config_samples

    ev = cfg.evaluation
    for part in ["train"] + (["valid"] if ev.eval_interval or ev.skip_train else []):
        try:
            config_samples(cfg, part)
        except DatasetError as e:
            raise ConfigError(str(e)) from None


def _check_loggers(cfg: TrainConfig) -> None:
    """--tensorboard-dir and --wandb-project need their packages; say which to install."""
    if cfg.logging.tensorboard_dir and not installed("tensorboard"):
        raise ConfigError(
            f"--tensorboard-dir {cfg.logging.tensorboard_dir}: TensorBoard's writer needs the "
            f'tensorboard package, which is not installed: pip install "hla-sp[tensorboard]"'
        )
    if cfg.logging.wandb_project and not installed("wandb"):
        raise ConfigError(
            f"--wandb-project {cfg.logging.wandb_project}: needs the wandb package, which is not "
            f"installed: pip install wandb (then wandb login, or WANDB_MODE=offline)"
        )


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

"""The trainer's flag checks: ranges, the parallel layout, data and checkpoint agreement.

:func:`validate` checks a config against a world size *before* any process group
exists, so a bad flag costs a second, not a cluster allocation, and says what to change.
It runs its steps in a fixed order, so the first problem reported stays the same.
"""

from __future__ import annotations

import argparse
import os
import typing

from hla_sp.launch.errors import ConfigError
from hla_sp.launch.resume_checks import (
    check_load,
    check_skip_train,
)
from hla_sp.launch.tokenizer import check_data_tokenizer, check_run_tokenizer

if typing.TYPE_CHECKING:
    from hla_sp.launch.config import TrainConfig



def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# Ranges of the numeric flags, checked before anything divides by them. (lo, hi):
# "[" / "(" closed / open ends; None: unbounded. Optional (None) values are skipped.
_RANGES: dict[str, tuple[str, float | None, float | None, str]] = {
    "num_layers": ("[", 1, None, "]"),
    "hidden_size": ("[", 1, None, "]"),
    "num_attention_heads": ("[", 1, None, "]"),
    "num_query_groups": ("[", 1, None, "]"),
    "ffn_hidden_size": ("[", 1, None, "]"),
    "max_position_embeddings": ("[", 1, None, "]"),
    "vocab_size": ("[", 1, None, "]"),
    "make_vocab_size_divisible_by": ("[", 1, None, "]"),
    "hidden_dropout": ("[", 0, 1, ")"),
    "attention_dropout": ("[", 0, 1, ")"),
    "init_method_std": ("(", 0, None, "]"),
    "micro_batch_size": ("[", 1, None, "]"),
    "global_batch_size": ("[", 1, None, "]"),
    "lr": ("[", 0, None, "]"),
    "min_lr": ("[", 0, None, "]"),
    "lr_warmup_iters": ("[", 0, None, "]"),
    "lr_decay_iters": ("[", 1, None, "]"),
    "weight_decay": ("[", 0, None, "]"),
    "adam_beta1": ("[", 0, 1, ")"),
    "adam_beta2": ("[", 0, 1, ")"),
    "adam_eps": ("(", 0, None, "]"),
    "clip_grad": ("[", 0, None, "]"),
    "seed": ("[", 0, 2**32 - 1, "]"),
    "context_parallel_size": ("[", 1, None, "]"),
    "tensor_model_parallel_size": ("[", 1, None, "]"),
    "distributed_timeout_minutes": ("(", 0, None, "]"),
    "ckpt_step": ("[", 0, None, "]"),
    "rotary_base": ("[", 1, None, "]"),
    "rotary_percent": ("(", 0, 1, "]"),
    "loss_scale": ("(", 0, None, "]"),
    "initial_loss_scale": ("(", 0, None, "]"),
    "min_loss_scale": ("(", 0, None, "]"),
    "loss_scale_window": ("[", 1, None, "]"),
    "hysteresis": ("[", 1, None, "]"),
    "eval_interval": ("[", 1, None, "]"),
    "eval_iters": ("[", 1, None, "]"),
}


def _check_ranges(cfg: TrainConfig) -> None:
    """Every numeric flag finite and in its range, named as on the command line."""
    import math

    for name, (lb, lo, hi, rb) in _RANGES.items():
        v = getattr(cfg, name)
        if v is None:
            continue
        ok = isinstance(v, (int, float)) and math.isfinite(v)
        ok = ok and (v >= lo if lb == "[" else v > lo)  # type: ignore[operator]
        if hi is not None:
            ok = ok and (v <= hi if rb == "]" else v < hi)
        if not ok:
            want = f"{lb}{lo}, {'inf' if hi is None else hi}{rb}"
            raise ConfigError(
                f"--{name.replace('_', '-')}: expected a finite value in {want}, got {v!r}"
            )


def validate(cfg: TrainConfig, world_size: int, *, offline: bool = False) -> None:
    """Reject configs that cannot run on ``world_size`` ranks; say what to change.

    Pure: touches no process group, so torchrun's workers (and ``hla-sp train``, before
    it starts torchrun) call it first. ``offline`` (``--dry-run``, planning a cluster
    job from a login node): the flags alone, with no data file, checkpoint or installed
    logger read, and what CUDA allows (RoPE) allowed on a machine without it.
    ``--tokenizer`` is loaded, and fills ``cfg.vocab_size`` when unset (its vocabulary).
    """
    _check_world_size(world_size)
    _check_ranges(cfg)
    check_run_tokenizer(cfg)  # before the checks that read the vocabulary
    _check_parallel_layout(cfg, world_size)
    _check_heads(cfg)
    _check_batch(cfg, world_size)
    _check_precision_and_device(cfg, offline)
    split_weights(cfg.split)
    _check_position_table(cfg)
    _check_attention(cfg)
    _check_schedule(cfg)
    _check_intervals(cfg)
    if offline:
        return
    _check_data(cfg)
    if cfg.load is not None:
        check_load(cfg)
    if cfg.skip_train:
        check_skip_train(cfg)
    _check_loggers(cfg)


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(
            f"world size: expected >= 1 process (--nproc-per-node x --nnodes), got {world_size!r}"
        )


def _check_parallel_layout(cfg: TrainConfig, world_size: int) -> None:
    """CP x TP divides the world; the sequence splits into Megatron's 2 x CP chunks."""
    cp, tp = cfg.context_parallel_size, cfg.tensor_model_parallel_size
    if cp < 1 or tp < 1:
        raise ConfigError("--context-parallel-size and --tensor-model-parallel-size must be >= 1")
    if world_size % (cp * tp):
        ok = [
            d for d in _divisors(world_size) if d * tp <= world_size and world_size % (d * tp) == 0
        ]
        raise ConfigError(
            f"--context-parallel-size {cp} x --tensor-model-parallel-size {tp} = {cp * tp} does "
            f"not divide the world size {world_size} (nproc-per-node x nnodes). Use a CP size "
            f"in {ok} with this TP size, or launch a multiple of {cp * tp} processes."
        )
    if cp > 1 and cfg.seq_length % (2 * cp):
        lo = cfg.seq_length // (2 * cp) * (2 * cp)
        raise ConfigError(
            f"--seq-length {cfg.seq_length} is not divisible by 2 x --context-parallel-size = "
            f"{2 * cp}, which Megatron's zigzag split needs (2 x CP equal chunks). Use "
            f"--seq-length {lo or 2 * cp} or {lo + 2 * cp}."
        )
    if cfg.seq_length < 2:
        raise ConfigError(f"--seq-length must be >= 2, got {cfg.seq_length}")


def _check_heads(cfg: TrainConfig) -> None:
    """Heads split the hidden size, query groups split the heads, TP splits both."""
    tp = cfg.tensor_model_parallel_size
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ConfigError(
            f"--hidden-size {cfg.hidden_size} is not divisible by --num-attention-heads "
            f"{cfg.num_attention_heads}; pick heads in {_divisors(cfg.hidden_size)}."
        )
    groups = cfg.num_query_groups or cfg.num_attention_heads
    if cfg.num_attention_heads % groups:
        raise ConfigError(
            f"--num-query-groups {groups} does not divide --num-attention-heads "
            f"{cfg.num_attention_heads}; pick one of {_divisors(cfg.num_attention_heads)}."
        )
    if cfg.num_attention_heads % tp or groups % tp:
        raise ConfigError(
            f"--tensor-model-parallel-size {tp} must divide --num-attention-heads "
            f"{cfg.num_attention_heads} and --num-query-groups {groups}."
        )


def _check_batch(cfg: TrainConfig, world_size: int) -> None:
    """The global batch is a whole number of micro-batches on every data-parallel rank."""
    dp = world_size // (cfg.context_parallel_size * cfg.tensor_model_parallel_size)
    gbs = cfg.global_batch_size or cfg.micro_batch_size * dp
    if gbs % (cfg.micro_batch_size * dp):
        raise ConfigError(
            f"--global-batch-size {gbs} must be a multiple of --micro-batch-size "
            f"{cfg.micro_batch_size} x data-parallel size {dp} = {cfg.micro_batch_size * dp}."
        )


def _check_precision_and_device(cfg: TrainConfig, offline: bool = False) -> None:
    if cfg.bf16 and cfg.fp16:
        raise ConfigError("--bf16 and --fp16 exclude each other; pass one of them.")
    if cfg.position_embedding_type == "rope" and not offline and not _cuda_available():
        raise ConfigError(
            "--position-embedding-type rope: megatron-core's rotary embedding runs on the "
            "current CUDA device, and this machine has none; on CPU use learned_absolute "
            "(the default) or none."
        )


# Above this many positions a learned table (positions x hidden parameters, trained from
# one sample per position per step) outweighs what it buys: RoPE, or no positions with
# HLA's decay, cost nothing per position. 65,536 x 2048 is already 134 M parameters.
MAX_LEARNED_POSITIONS = 65536


def _check_position_table(cfg: TrainConfig) -> None:
    if cfg.position_embedding_type == "learned_absolute":
        mpe = cfg.max_position_embeddings or cfg.seq_length
        if max(mpe, cfg.seq_length) > MAX_LEARNED_POSITIONS:
            n = mpe * cfg.hidden_size
            raise ConfigError(
                f"--position-embedding-type learned_absolute at --seq-length "
                f"{cfg.seq_length:,}: the position table would be {mpe:,} x {cfg.hidden_size} "
                f"= {n / 1e9:.2f} B parameters; above {MAX_LEARNED_POSITIONS:,} positions use "
                f"--position-embedding-type rope (CUDA) or none (HLA's decay orders tokens)."
            )
        if mpe < cfg.seq_length:
            raise ConfigError(
                f"--max-position-embeddings {mpe} < --seq-length {cfg.seq_length}; raise it, "
                f"or use --position-embedding-type none."
            )


def _check_attention(cfg: TrainConfig) -> None:
    """The HLA flags (the Megatron drop-in's own checks) and softmax's need for CUDA."""
    from hla_sp.megatron_patch import check_hla_args

    try:
        check_hla_args(argparse.Namespace(**cfg.hla))
        from hla_sp.megatron_patch.hybrid import check_trainer_hybrid

        check_trainer_hybrid(cfg.hla, num_layers=cfg.num_layers,
                             context_parallel_size=cfg.context_parallel_size,
                             cuda=_cuda_available())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.attention == "softmax" and not _cuda_available():
        raise ConfigError(
            "--attention softmax runs megatron-core's DotProductAttention, which needs CUDA; "
            "on CPU use --attention hla2 (or ahla, hla3)."
        )


def _check_schedule(cfg: TrainConfig) -> None:
    """Iterations and the learning-rate schedule."""
    if cfg.train_iters < 1:
        raise ConfigError(f"--train-iters must be >= 1, got {cfg.train_iters}")
    decay = cfg.lr_decay_iters or cfg.train_iters
    if cfg.lr_warmup_iters >= decay and cfg.lr_decay_style != "constant":
        raise ConfigError(
            f"--lr-warmup-iters {cfg.lr_warmup_iters} must be < the decay length {decay} "
            f"(--lr-decay-iters, default --train-iters)."
        )
    if cfg.min_lr > cfg.lr:
        raise ConfigError(f"--min-lr {cfg.min_lr} must be <= --lr {cfg.lr}.")


def _check_data(cfg: TrainConfig) -> None:
    """--data-path names readable indexed datasets; the recall layout fits the CP split."""
    if cfg.data_path:
        if cfg.data != "text":
            raise ConfigError("--data-path goes with --data text; drop one of them.")
        from hla_sp.launch.data import DatasetError, parse_data_path
        from hla_sp.launch.indexed_dataset import check_indexed_dataset

        try:  # Megatron's weighted form, 0.5 A 0.5 B, names the prefixes A and B
            prefixes = parse_data_path(cfg.data_path)[0]
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
    if cfg.data == "text":
        _check_samples(cfg)
    if cfg.data == "synthetic-recall":
        from hla_sp.launch.data import recall_layout_error

        msg = recall_layout_error(cfg.seq_length, cfg.context_parallel_size, cfg.recall_pairs)
        if msg:
            raise ConfigError(msg)


def _check_samples(cfg: TrainConfig) -> None:
    """The text data holds at least one sample of --seq-length in the training split,
    and in the validation split when it is read (--eval-interval, --skip-train): the
    sample sources the trainer builds, built here (opening an indexed dataset reads no
    tokens), so that a small file fails before any process starts."""
    from hla_sp.launch.data import DatasetError, build_samples

    parts = ["train"] + (["valid"] if cfg.eval_interval or cfg.skip_train else [])
    for part in parts:
        try:
            build_samples(cfg.data, cfg.data_path, cfg.seq_length, cfg.seed, cfg.recall_pairs,
                          split_weights(cfg.split), part=part, vocab_size=cfg.vocab_size)
        except DatasetError as e:
            raise ConfigError(str(e)) from None


def _check_intervals(cfg: TrainConfig) -> None:
    for name in ("save_interval", "exit_interval", "log_interval"):
        v = getattr(cfg, name)
        if v is not None and v < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if cfg.distributed_timeout_minutes <= 0:
        raise ConfigError("--distributed-timeout-minutes must be > 0")


def _check_loggers(cfg: TrainConfig) -> None:
    """--tensorboard-dir and --wandb-project need their packages; say which to install."""
    from hla_sp.launch.extras import installed

    if cfg.tensorboard_dir and not installed("tensorboard"):
        raise ConfigError(
            f"--tensorboard-dir {cfg.tensorboard_dir}: TensorBoard's writer needs the "
            f'tensorboard package, which is not installed: pip install "hla-sp[tensorboard]"'
        )
    if cfg.wandb_project and not installed("wandb"):
        raise ConfigError(
            f"--wandb-project {cfg.wandb_project}: needs the wandb package, which is not "
            f"installed: pip install wandb (then wandb login, or WANDB_MODE=offline)"
        )
    if cfg.wandb_exp_name and not cfg.wandb_project:
        raise ConfigError(
            f"--wandb-exp-name {cfg.wandb_exp_name}: goes with --wandb-project NAME, got none"
        )


def split_weights(split: str) -> tuple[float, float, float]:
    """Megatron's ``--split`` ("969,30,1", "90,10" or "100") as fractions summing to 1."""
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or any(not x >= 0 for x in parts) or sum(parts) <= 0:
        raise ConfigError(
            f"--split: expected up to three weights train,valid,test such as 969,30,1, "
            f"got {split!r}"
        )
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return parts[0] / total, parts[1] / total, parts[2] / total

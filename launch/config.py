"""The trainer's configuration: one dataclass, one docstring per field, which is the CLI help.

Flags use Megatron-LM's spellings (``--num-layers``, ``--seq-length``,
``--context-parallel-size``, ...). The HLA flags (``--attention``, ``--hla-*``) come
from :func:`hla_sp.megatron_patch.add_hla_args`, so the trainer and Megatron's own
``pretrain_gpt`` accept the same ones.

:func:`validate` checks a config against a world size *before* any process group
exists, so a bad flag costs a second, not a cluster allocation, and says what to change.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import os
import textwrap
import types
import typing
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A flag or flag combination that cannot work; the message says what to change."""


@dataclass
class TrainConfig:
    """Everything ``hla_sp.launch.train`` needs; each field is the flag ``--field-name``."""

    # --- model -------------------------------------------------------------------
    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Transformer hidden size."""
    num_attention_heads: int = 4
    """Number of attention (query) heads."""
    num_query_groups: int | None = None
    """Key/value head groups for GQA (default: one per head)."""
    ffn_hidden_size: int | None = None
    """MLP hidden size (default: 4 x hidden size)."""
    seq_length: int = 256
    """Tokens per sample. With context parallelism it must be divisible by
    2 x context-parallel-size (Megatron's zigzag split)."""
    max_position_embeddings: int | None = None
    """Size of the learned position table (default: seq-length)."""
    position_embedding_type: str = "learned_absolute"
    """learned_absolute, rope or none. rope needs CUDA (megatron-core's rotary embedding
    runs on the current CUDA device) and is refused on CPU; HLA with decay needs no
    positions, and none saves seq-length x hidden parameters at long context."""
    rotary_base: int = 10000
    """Base of the rotary embedding's frequencies (--position-embedding-type rope)."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that RoPE rotates."""
    vocab_size: int | None = None
    """Vocabulary size before padding (default: 257 byte-level tokens for the built-in
    data, else the largest token id in --data-path plus one)."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times the tensor-parallel size."""
    hidden_dropout: float = 0.0
    """Dropout after attention and MLP. Megatron defaults to 0.1; 0 is the usual choice
    for pretraining and keeps runs comparable across CP sizes."""
    attention_dropout: float = 0.0
    """Dropout inside core attention (passed to the core attention)."""
    init_method_std: float = 0.02
    """Standard deviation of the weight initialisation."""

    # --- batching and optimisation -----------------------------------------------
    micro_batch_size: int = 1
    """Samples per microbatch on each data-parallel rank."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all data-parallel ranks (default: micro-batch
    size x data-parallel size); the rest is gradient accumulation."""
    train_iters: int = 20
    """Optimizer steps to train for."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the decay."""
    lr_warmup_iters: int = 0
    """Linear warmup steps from 0 to --lr."""
    lr_decay_iters: int | None = None
    """Steps over which the learning rate decays to --min-lr (default: --train-iters)."""
    lr_decay_style: str = "cosine"
    """cosine, linear or constant."""
    weight_decay: float = 0.01
    """AdamW weight decay (not applied to biases and norms)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    seed: int = 1234
    """Seed for initialisation, dropout and data order."""

    # --- precision (Megatron's mixed precision: fp32 master weights and grads) -----
    bf16: bool = False
    """Run the model in bfloat16; the optimizer keeps fp32 master weights and
    gradients are accumulated, reduced and clipped in fp32 (Megatron's --bf16)."""
    fp16: bool = False
    """Run the model in float16 with fp32 master weights and a loss scale (dynamic
    unless --loss-scale is set); steps whose gradients overflow are skipped."""
    loss_scale: float | None = None
    """With --fp16: a static loss scale (default: dynamic)."""
    initial_loss_scale: float = 2.0**32
    """With --fp16: the dynamic loss scale's initial value."""
    min_loss_scale: float = 1.0
    """With --fp16: the dynamic loss scale never goes below this."""
    loss_scale_window: int = 1000
    """With --fp16: steps without overflow before the dynamic scale doubles."""
    hysteresis: int = 2
    """With --fp16: overflowing steps tolerated before the dynamic scale halves."""

    # --- parallelism -------------------------------------------------------------
    context_parallel_size: int = 1
    """Ranks that share one sequence (HLA's exact scan runs across them)."""
    tensor_model_parallel_size: int = 1
    """Ranks that share each weight matrix (Megatron tensor parallelism)."""
    distributed_timeout_minutes: float = 10.0
    """Process-group timeout: a hung or dead peer ends every rank after this long."""

    # --- memory ------------------------------------------------------------------
    recompute_activations: bool = False
    """Recompute core attention in backward (Megatron's selective recompute)."""
    recompute_granularity: str | None = None
    """full (recompute every transformer layer; the least memory) or selective."""

    # --- data --------------------------------------------------------------------
    data: str = "text"
    """text (Megatron data from --data-path, else the Python standard library's sources
    as bytes) or synthetic-recall (key-value pairs early, queried in the second half;
    the loss can only fall below ln(64) if information crosses context-parallel ranks)."""
    data_path: list[str] | None = None
    """Prefixes of Megatron indexed datasets (PREFIX.bin and PREFIX.idx), concatenated."""
    recall_pairs: int = 8
    """Key-value pairs per sample for --data synthetic-recall."""
    split: str = "969,30,1"
    """Train, validation and test weights of the data (Megatron's --split): the first
    share of the samples trains, the next is the held-out validation set."""

    # --- evaluation --------------------------------------------------------------
    eval_interval: int | None = None
    """Compute the validation loss every this many iterations and at the end (default:
    never)."""
    eval_iters: int = 10
    """Global batches of the validation split per evaluation (the same ones each time)."""

    # --- checkpoints -------------------------------------------------------------
    save: str | None = None
    """Directory to write checkpoints to (atomically)."""
    load: str | None = None
    """Directory to resume from (its latest complete checkpoint)."""
    ckpt_step: int | None = None
    """With --load: resume from this iteration's checkpoint instead of the latest."""
    save_interval: int | None = None
    """Save every this many iterations (and always at the end when --save is set)."""
    exit_interval: int | None = None
    """Stop (saving first when --save is set) once the iteration is a multiple of this."""

    # --- logging -----------------------------------------------------------------
    log_interval: int = 1
    """Print a progress line every this many iterations (rank 0)."""
    log_jsonl: str | None = None
    """Append one JSON object per iteration to this file (rank 0); a line with "event":
    "start" marks where each run (or resumed run) begins. At the end of the run a plot of
    loss and throughput goes next to it (same name, .png; needs matplotlib)."""

    # --- attention (filled from hla_sp.megatron_patch.add_hla_args) --------------
    hla: dict[str, Any] = field(default_factory=dict)
    """The --attention and --hla-* flags, as parsed by add_hla_args."""

    # ------------------------------------------------------------------------------
    @property
    def attention(self) -> str:
        """The core attention: softmax, hla2, ahla or hla3."""
        return str(self.hla.get("attention", "softmax"))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly copy (what checkpoints and Ray workers carry)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown config keys {sorted(unknown)}; known: {sorted(names)}")
        return cls(**d)


_CHOICES = {
    "position_embedding_type": ["learned_absolute", "rope", "none"],
    "lr_decay_style": ["cosine", "linear", "constant"],
    "recompute_granularity": ["full", "selective"],
    "data": ["text", "synthetic-recall"],
}


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under each dataclass field (the torchtitan convention)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _base_type(tp: Any) -> tuple[type, bool]:
    """(element type, is_list) of an annotation like ``int | None`` or ``list[str] | None``."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        tp = args[0]
    if typing.get_origin(tp) is list:
        return typing.get_args(tp)[0], True
    return tp, False


def add_hla_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--attention`` and the ``--hla-*`` flags from the Megatron drop-in."""
    from hla_sp.megatron_patch import add_hla_args

    add_hla_args(parser)
    from hla_sp.megatron_patch.hybrid import add_hybrid_args

    add_hybrid_args(parser)  # --hla-layer-pattern: HLA in some layers, softmax in the rest
    # The trainer exists to train HLA; Megatron's own entry point keeps softmax as default.
    parser.set_defaults(attention="hla2")


class _RaisingParser(argparse.ArgumentParser):
    """A parser whose errors raise :class:`ConfigError` instead of printing usage and
    exiting (for callers such as the sweep, which name their own file and key)."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(message)


def build_parser(
    prog: str = "hla_sp.launch.train", raise_errors: bool = False
) -> argparse.ArgumentParser:
    """The trainer's argument parser, generated from :class:`TrainConfig`."""
    parser = (_RaisingParser if raise_errors else argparse.ArgumentParser)(
        prog=prog,
        description="Train a megatron-core GPT with HLA attention and context parallelism.",
        allow_abbrev=False,  # as Megatron's parser: no prefix surprises between flags
    )
    docs = field_docs(TrainConfig)
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name == "hla":
            continue
        flag = "--" + f.name.replace("_", "-")
        tp, is_list = _base_type(hints[f.name])
        help_text = docs.get(f.name, "")
        if tp is bool:
            parser.add_argument(flag, action="store_true", help=help_text)
            continue
        default = f.default
        kw: dict[str, Any] = {"type": tp, "default": default, "help": help_text}
        if is_list:
            kw["nargs"] = "+"
        if f.name in _CHOICES:
            kw["choices"] = _CHOICES[f.name]
        if default is not None and not is_list:
            kw["help"] = f"{help_text} (default: {default})"
        parser.add_argument(flag, **kw)
    add_hla_flags(parser)
    return parser


def parse_args(argv: list[str] | None = None, raise_errors: bool = False) -> TrainConfig:
    """Parse trainer flags into a :class:`TrainConfig` (the HLA flags land in ``cfg.hla``);
    with ``raise_errors`` a bad flag raises :class:`ConfigError` instead of exiting."""
    ns = vars(build_parser(raise_errors=raise_errors).parse_args(argv))
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    hla = {k: v for k, v in ns.items() if k not in names}
    return TrainConfig(**{k: v for k, v in ns.items() if k in names}, hla=hla)


def flag_names() -> dict[str, str]:
    """Every trainer flag's destination name (``hidden_size``, ``hla_decay``) -> flag."""
    out = {}
    for action in build_parser()._actions:
        if action.dest != "help" and action.option_strings:
            out[action.dest] = action.option_strings[0]
    return out


def world_size_from_env() -> int:
    """The world size torchrun (or Ray, or SLURM via torchrun) announces, 1 if none."""
    return int(os.environ.get("WORLD_SIZE", "1"))


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


def validate(cfg: TrainConfig, world_size: int) -> None:
    """Reject configs that cannot run on ``world_size`` ranks; say what to change.

    Pure: touches no process group, so torchrun's workers (and ``hla-sp train``, before
    it starts torchrun) call it first.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(
            f"world size: expected >= 1 process (--nproc-per-node x --nnodes), got {world_size!r}"
        )
    _check_ranges(cfg)
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
    dp = world_size // (cp * tp)
    gbs = cfg.global_batch_size or cfg.micro_batch_size * dp
    if gbs % (cfg.micro_batch_size * dp):
        raise ConfigError(
            f"--global-batch-size {gbs} must be a multiple of --micro-batch-size "
            f"{cfg.micro_batch_size} x data-parallel size {dp} = {cfg.micro_batch_size * dp}."
        )
    if cfg.bf16 and cfg.fp16:
        raise ConfigError("--bf16 and --fp16 exclude each other; pass one of them.")
    if cfg.position_embedding_type == "rope" and not _cuda_available():
        raise ConfigError(
            "--position-embedding-type rope: megatron-core's rotary embedding runs on the "
            "current CUDA device, and this machine has none; on CPU use learned_absolute "
            "(the default) or none."
        )
    split_weights(cfg.split)
    if cfg.position_embedding_type == "learned_absolute":
        mpe = cfg.max_position_embeddings or cfg.seq_length
        if mpe < cfg.seq_length:
            raise ConfigError(
                f"--max-position-embeddings {mpe} < --seq-length {cfg.seq_length}; raise it, "
                f"or use --position-embedding-type none."
            )
    from hla_sp.megatron_patch import check_hla_args

    try:
        check_hla_args(argparse.Namespace(**cfg.hla))
        from hla_sp.megatron_patch.hybrid import check_trainer_hybrid

        check_trainer_hybrid(cfg.hla, num_layers=cfg.num_layers, context_parallel_size=cp,
                             cuda=_cuda_available())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.attention == "softmax" and not _cuda_available():
        raise ConfigError(
            "--attention softmax runs megatron-core's DotProductAttention, which needs CUDA; "
            "on CPU use --attention hla2 (or ahla, hla3)."
        )
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
    if cfg.data_path:
        if cfg.data != "text":
            raise ConfigError("--data-path goes with --data text; drop one of them.")
        from hla_sp.launch.data import DatasetError, check_indexed_dataset

        for prefix in cfg.data_path:
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
    if cfg.data == "synthetic-recall":
        from hla_sp.launch.data import recall_layout_error

        msg = recall_layout_error(cfg.seq_length, cp, cfg.recall_pairs)
        if msg:
            raise ConfigError(msg)
    if cfg.load is not None:
        _check_load(cfg)
    for name in ("save_interval", "exit_interval", "log_interval"):
        v = getattr(cfg, name)
        if v is not None and v < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if cfg.distributed_timeout_minutes <= 0:
        raise ConfigError("--distributed-timeout-minutes must be > 0")


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


# The flags that shape the model's parameters or their files: a checkpoint written with
# other values cannot be loaded (a size mismatch in load_state_dict on every rank).
# chunk size and the exchange method change no parameter, so they may differ.
MODEL_FLAGS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
    "position_embedding_type", "max_position_embeddings", "vocab_size",
    "make_vocab_size_divisible_by", "tensor_model_parallel_size", "bf16", "fp16",
)
_FREE_HLA = ("hla_chunk_size", "hla_sp_method")


def _model_shape(d: dict[str, Any]) -> dict[str, Any]:
    """The values of :data:`MODEL_FLAGS` and the HLA options of a config dict; the
    position table's size as it is built (it defaults to --seq-length)."""
    out = {k: d.get(k) for k in MODEL_FLAGS if k in d}
    if d.get("position_embedding_type") == "learned_absolute":
        out["max_position_embeddings"] = d.get("max_position_embeddings") or d.get("seq_length")
    for k, v in (d.get("hla") or {}).items():
        if k not in _FREE_HLA:
            out[k] = v
    return out


def config_diff(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``--flag SAVED (checkpoint) != NOW (this run)`` for every model flag that differs;
    flags the checkpoint does not record (older versions) are not compared."""
    a, b = _model_shape(saved), _model_shape(now)
    out = []
    for k in b:
        if k in a and a[k] != b[k]:
            flag = "--" + k.replace("_", "-")
            out.append(f"{flag} {a[k]} (checkpoint) != {b[k]} (this run)")
    return out


def _check_load(cfg: TrainConfig) -> None:
    """--load as Megatron reads it: a missing or empty directory starts fresh (the
    trainer says so), a checkpoint of another model is refused with the flags that differ."""
    from hla_sp.launch.checkpoint import CheckpointError, latest_iteration, saved_config

    load = cfg.load
    assert load is not None
    if cfg.ckpt_step is not None and not os.path.isdir(load):
        raise ConfigError(f"--load {load} --ckpt-step {cfg.ckpt_step}: no such directory.")
    if not os.path.isdir(load):
        return  # nothing to resume: a fresh start, as in Megatron
    try:
        it = latest_iteration(load) if cfg.ckpt_step is None else cfg.ckpt_step
        if it is None:
            return
        saved = saved_config(load, it)
    except CheckpointError as e:
        raise ConfigError(f"--load {load}: {e}") from None
    if saved is None:
        return
    diff = config_diff(saved, cfg.to_dict())
    if diff:
        raise ConfigError(
            f"--load {load}: the checkpoint at iteration {it} holds another model: "
            + "; ".join(diff)
            + ". Pass the checkpoint's values, or --save to a new directory without --load."
        )

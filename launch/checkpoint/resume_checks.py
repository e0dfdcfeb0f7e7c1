"""The checks of a run against the checkpoint it resumes: the same model (the flags that
shape its parameters, each default counted as the value it stands for), and for
``--skip-train`` a checkpoint to evaluate. Called by :func:`hla_sp.launch.checks.validate`
before any process group exists."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from hla_sp.launch.checkpoint import CheckpointError, resume_iteration
from hla_sp.launch.errors import ConfigError

if TYPE_CHECKING:
    from hla_sp.launch.config.train_config import TrainConfig

__all__ = ["MODEL_FLAGS", "check_load", "check_skip_train", "config_diff"]


# The flags that shape the model's parameters or their files: a checkpoint written with
# other values cannot be loaded (a size mismatch in load_state_dict on every rank).
# The chunk size, the exchange method and the stages' precision change no parameter, and
# the checkpoint's pieces reshard across TP, CP and DP sizes, so those may differ. The
# tokenizer gives the embedding's rows their meaning: another one of the same size loads
# without an error and trains garbage.
MODEL_FLAGS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
    "position_embedding_type", "max_position_embeddings", "vocab_size",
    "make_vocab_size_divisible_by", "bf16", "fp16", "tokenizer",
)
# Flags of the HLA group that change no parameter: they may differ on resume (the
# modules --custom-import names only make the operator known; --attention says which).
_FREE_HLA = ("hla_chunk_size", "hla_sp_method", "hla_precision", "custom_import")


def _model_shape(d: dict[str, Any]) -> dict[str, Any]:
    """The values of :data:`MODEL_FLAGS` and the HLA options of a config dict; the
    position table's size as it is built (it defaults to --seq-length)."""
    out = {k: d.get(k) for k in MODEL_FLAGS if k in d}
    # a default recorded as None is the value it stands for: a run that spells the
    # default out (--num-query-groups = heads, --ffn-hidden-size 4h, --vocab-size 257)
    # builds the same model
    if "num_query_groups" in out and out["num_query_groups"] is None:
        out["num_query_groups"] = d.get("num_attention_heads")
    if "ffn_hidden_size" in out and out["ffn_hidden_size"] is None and d.get("hidden_size"):
        out["ffn_hidden_size"] = 4 * d["hidden_size"]
    if "vocab_size" in out and out["vocab_size"] is None:
        from hla_sp.launch.data.datasets import BYTE_VOCAB

        out["vocab_size"] = BYTE_VOCAB
    if d.get("position_embedding_type") == "learned_absolute":
        out["max_position_embeddings"] = d.get("max_position_embeddings") or d.get("seq_length")
    for k, v in (d.get("hla") or {}).items():
        if k not in _FREE_HLA:
            out[k] = v
    return out


def config_diff(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``--flag SAVED (checkpoint) != NOW (this run)`` for every model flag that differs;
    flags the checkpoint does not record (older versions) are not compared. Either config
    may be in sections or in the flat form of earlier versions."""
    from hla_sp.launch.config.train_config import flat_config

    a, b = _model_shape(flat_config(saved)), _model_shape(flat_config(now))
    out = []
    for k in b:
        if k in a and a[k] != b[k]:
            flag = "--" + k.replace("_", "-")
            out.append(f"{flag} {a[k]} (checkpoint) != {b[k]} (this run)")
    return out


def check_skip_train(cfg: TrainConfig) -> None:
    """--skip-train evaluates a checkpoint: it needs one in --load and writes none."""
    if cfg.checkpoint.save is not None:
        raise ConfigError(f"--skip-train trains and saves nothing: expected no --save, "
                          f"got --save {cfg.checkpoint.save}")
    if cfg.checkpoint.load is None:
        raise ConfigError("--skip-train: expected --load naming a directory with a "
                          "checkpoint to evaluate, got no --load")
    try:
        it = resume_iteration(cfg.checkpoint.load, cfg.checkpoint.ckpt_step)
    except CheckpointError as e:
        raise ConfigError(f"--load {cfg.checkpoint.load}: {e}") from None
    if it is None:
        raise ConfigError(f"--skip-train: expected --load naming a directory with a "
                          f"checkpoint to evaluate, got --load {cfg.checkpoint.load}, which "
                          f"holds none")


def check_load(cfg: TrainConfig) -> None:
    """--load as Megatron reads it: a missing or empty directory starts fresh (the
    trainer says so), a checkpoint of another model is refused with the flags that differ."""
    from hla_sp.launch.checkpoint import CheckpointError, latest_iteration, saved_config

    load = cfg.checkpoint.load
    assert load is not None
    step = cfg.checkpoint.ckpt_step
    if step is not None and not os.path.isdir(load):
        raise ConfigError(f"--load {load} --ckpt-step {step}: no such directory.")
    if not os.path.isdir(load):
        return  # nothing to resume: a fresh start, as in Megatron
    try:
        it = latest_iteration(load) if step is None else step
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

"""The run's flags in a checkpoint (``config.json``): read, and checked key by key.

``--load`` compares them with the new run's flags before any process group exists, so
a malformed file must fail in one line that names the key, never deep inside the trainer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from typing import Any

import torch
from hla_sp.launch.checkpoint.layout import (
    COMMON,
    CONFIG,
    LEGACY_MODEL,
    CheckpointError,
    checkpoint_dir,
    read_torch_file,
)
from hla_sp.launch.errors import ConfigError
from hla_sp.megatron_patch.args import import_custom

# deeper than this, a config.json is not one the trainer wrote (its deepest value is a
# list inside the hla table: depth 3); checked before json.loads, which would recurse
_MAX_JSON_DEPTH = 32


def _json_depth_error(text: str) -> str | None:
    """The top-level key under which ``text`` nests deeper than :data:`_MAX_JSON_DEPTH`
    (a scan outside strings, without recursion), or None."""
    depth, in_str, esc, key, last_str = 0, False, False, None, ""
    start = 0
    for i, c in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                last_str = text[start:i]
        elif c == '"':
            in_str, start = True, i + 1
        elif c == ":" and depth == 1:
            key = last_str
        elif c in "[{":
            depth += 1
            if depth > _MAX_JSON_DEPTH:
                return f"key {key!r}" if key is not None else "the top level"
        elif c in "]}":
            depth -= 1
    return None


def _type_error(name: str, value: Any, hint: Any) -> str | None:
    """Why ``value`` cannot be the value of config field ``name`` (annotation ``hint``),
    or None if it can."""

    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        wants = [_type_error(name, value, a) for a in args if a is not type(None)]
        return None if None in wants else " or ".join(w for w in wants if w)
    origin = typing.get_origin(hint)
    if origin is list:
        elem = (typing.get_args(hint) or (str,))[0]
        ok = isinstance(value, list) and all(
            isinstance(v, elem) and not isinstance(v, bool) for v in value)
        return None if ok else f"a list of {'strings' if elem is str else 'integers'}"
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            return "an object"
        for k, v in value.items():
            if isinstance(v, list):
                if not all(isinstance(x, (str, int, float, bool)) or x is None for x in v):
                    return f"an object of plain values (its {k!r} holds {v!r:.40})"
            elif not (isinstance(v, (str, int, float, bool)) or v is None):
                return f"an object of plain values (its {k!r} holds {v!r:.40})"
        return None
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else "a number"
    if hint is str:
        return None if isinstance(value, str) else "a string"
    return None


def check_config_dict(cfg: Any, where: str) -> dict[str, Any]:
    """A saved trainer config, in sections or in the flat form of earlier versions, every
    known key of the right type; keys this version does not know (a newer trainer's) are
    kept. Raises :class:`CheckpointError` naming the key, its value and what was expected."""

    from hla_sp.launch.config.train_config import SECTIONS, is_sectioned

    if not isinstance(cfg, dict):
        raise CheckpointError(f"{where}: expected a JSON object of flags, got {type(cfg).__name__}")
    if is_sectioned(cfg):
        tables = [(f"{name}.", cls, cfg.get(name)) for name, cls in SECTIONS.items()]
        for name in ("hla", *SECTIONS):
            if name in cfg and not isinstance(cfg[name], dict):
                raise CheckpointError(
                    f"{where}: key {name!r}: expected an object, got {cfg[name]!r:.60}; the "
                    f"file is corrupt or was not written by this trainer")
    else:  # flat: every section's fields at the top, and the hla table
        tables = [("", cls, cfg) for cls in SECTIONS.values()]
        tables.append(("", type("Flat", (), {"__annotations__": {"hla": dict}}), cfg))
    for prefix, cls, values in tables:
        hints = typing.get_type_hints(cls)
        names = ([f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls)
                 else list(hints))
        for name in names:
            if values and name in values:
                want = _type_error(name, values[name], hints[name])
                if want:
                    raise CheckpointError(
                        f"{where}: key {prefix + name!r}: expected {want}, got "
                        f"{values[name]!r:.60}; the file is corrupt or was not written by "
                        f"this trainer")
    return cfg


def saved_config(root: str, iteration: int) -> dict[str, Any] | None:
    """The trainer config a checkpoint was written with: its ``config.json``, else (older
    checkpoints) the ``config`` entry of the model file, memory-mapped; None if absent.
    A malformed one raises :class:`CheckpointError` in one line naming the key."""
    d = checkpoint_dir(root, iteration)
    if not os.path.isdir(d):
        raise CheckpointError(f"no complete checkpoint {d} (iteration {iteration})")
    path = os.path.join(d, CONFIG)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot read the run's config ({e})") from None
        deep = _json_depth_error(text)
        if deep:
            raise CheckpointError(
                f"{path}: {deep} nests more than {_MAX_JSON_DEPTH} levels deep; the file is "
                f"corrupt or was not written by this trainer")
        try:
            out = json.loads(text)
        except ValueError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from None
        return check_config_dict(out, path)
    model_file = os.path.join(d, LEGACY_MODEL)
    if not os.path.isfile(model_file):
        return None
    try:
        state = torch.load(model_file, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None  # the load itself reports a broken file, naming it
    cfg = state.get("config") if isinstance(state, dict) else None
    return check_config_dict(cfg, f"{model_file} (its config entry)") if cfg is not None else None


def saved_losses(root: str, iteration: int) -> dict[str, float]:
    """The losses the trainer recorded with a checkpoint (``common.pt``): ``loss``, the
    saved iteration's training loss, and ``val_loss``, its validation loss when it was
    evaluated at that iteration (nats per token); empty when it records none."""
    path = os.path.join(checkpoint_dir(root, iteration), COMMON)
    if not os.path.isfile(path):  # the first format keeps no common.pt
        return {}
    extra = read_torch_file(path, "iteration, losses and optimizer settings").get("extra")
    losses = extra.get("losses") if isinstance(extra, dict) else None
    return {k: float(v) for k, v in (losses or {}).items()}


def load_run_config(load: str, step: int | None = None) -> tuple[Any, int]:
    """The :class:`~hla_sp.launch.config.train_config.TrainConfig` of the checkpoint
    under ``load`` (its latest iteration, or ``step``), with the modules its run named by
    --custom-import imported again (they register its operator); (config, iteration).
    What generate, export and eval read first. Raises ConfigError (or CheckpointError: a
    checkpoint recorded non-finite) in one line."""
    from hla_sp.launch.checkpoint.layout import LATEST, checkpoint_dir, latest_iteration
    from hla_sp.launch.config.train_config import TrainConfig, flat_config

    if not os.path.isdir(load):
        raise ConfigError(f"--load {load}: no such directory")
    it = latest_iteration(load) if step is None else step
    if it is None:
        raise ConfigError(f"--load {load}: no complete checkpoint there (expected {LATEST} "
                          f"and an iter_ directory from --save)")
    saved = saved_config(load, it)
    where = checkpoint_dir(load, it)
    if saved is None:
        raise ConfigError(f"{where}: no config.json (the checkpoint does not say which model "
                          f"it holds)")
    try:
        # the modules that registered the run's operator, in either form of config.json
        import_custom((flat_config(saved).get("hla") or {}).get("custom_import") or [])
    except ValueError as e:
        raise ConfigError(f"{where}: the run's {e}") from None
    from hla_sp.launch.checkpoint.manifest import refuse_non_finite

    refuse_non_finite(load, where, it)  # before any reader builds a model for it
    try:
        return TrainConfig.from_dict(saved), it
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{where}/config.json: {e}") from None

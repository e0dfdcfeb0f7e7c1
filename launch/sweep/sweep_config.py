"""The sweep file of ``hla-sp sweep``: reading it, checking it, and its grid points.

Everything here runs before Ray starts: the file's keys and values (errors name the
file and the key), each grid point's trainer config, and the resources the largest
world size needs. The keys are documented in :mod:`hla_sp.launch.ray_sweep`.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from hla_sp.launch.config.train_config import (
    ConfigError,
    TrainConfig,
    build_parser,
    flag_names,
    parse_args,
)

_KNOWN = {"world_sizes", "seq_lengths", "train_iters", "use_gpu", "output_dir", "ray", "trainer"}
# ray.init arguments a sweep file may set (a typo would otherwise reach Ray as a TypeError)
_RAY_KEYS = {"num_cpus", "num_gpus", "address", "object_store_memory", "namespace",
             "runtime_env", "_temp_dir"}


def _read(path: str) -> dict[str, Any]:
    """The file's mapping; errors name the file (missing, wrong format, syntax)."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".json", ".toml"):
        raise ConfigError(f"{path}: expected a .json or .toml sweep file, got {ext or 'no'} "
                          f"extension (see examples/sweep.toml)")
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file (examples/sweep.toml and examples/sweep.json "
                          f"are sweeps to start from)")
    try:
        if ext == ".json":
            with open(path) as f:
                cfg = json.load(f)
        else:
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib  # type: ignore[no-redef]
            with open(path, "rb") as f:
                cfg = tomllib.load(f)
    except ValueError as e:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise ConfigError(f"{path}: not valid {ext[1:].upper()}: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: expected a mapping of keys at the top level")
    return cfg


def load_config(path: str) -> dict[str, Any]:
    """Read and check a sweep config (``.json`` or ``.toml``); errors name file and key."""
    cfg = _read(path)
    unknown = set(cfg) - _KNOWN
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(_KNOWN)}")
    for key in ("world_sizes", "seq_lengths"):
        v = cfg.get(key)
        if not isinstance(v, list) or not v or not all(
            isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v
        ):
            raise ConfigError(f"{path}: {key}: expected a non-empty list of positive "
                              f"integers, got {v!r}")
    it = cfg.get("train_iters", 3)
    if isinstance(it, bool) or not isinstance(it, int) or it < 1:
        raise ConfigError(f"{path}: train_iters: expected an integer >= 1, got {it!r}")
    if not isinstance(cfg.get("use_gpu", False), bool):
        raise ConfigError(f"{path}: use_gpu: expected true or false, got {cfg['use_gpu']!r}")
    if not isinstance(cfg.get("output_dir", ""), str):
        raise ConfigError(f"{path}: output_dir: expected a string, got {cfg['output_dir']!r}")
    for table in ("ray", "trainer"):
        if not isinstance(cfg.get(table, {}), dict):
            raise ConfigError(f"{path}: [{table}]: expected a table of keys, got "
                              f"{cfg[table]!r}")
    bad = set(cfg.get("ray", {})) - _RAY_KEYS
    if bad:
        raise ConfigError(f"{path}: [ray] unknown keys {sorted(bad)}; known: "
                          f"{sorted(_RAY_KEYS)}")
    _check_trainer_table(path, cfg.get("trainer", {}))
    return cfg


def _check_trainer_table(path: str, table: dict[str, Any]) -> None:
    """Every ``[trainer]`` key a trainer flag, every value one it parses."""
    names = flag_names()
    fixed = {"seq_length": "seq_lengths", "train_iters": "train_iters"}
    for key, value in table.items():
        k = key.replace("-", "_")
        if k in fixed:
            raise ConfigError(f"{path}: [trainer] {key}: set by the sweep; use the top-level "
                              f"key {fixed[k]}")
        if k not in names:
            close = sorted(n for n in names if n.split("_")[-1] in k or k.split("_")[-1] in n)
            raise ConfigError(f"{path}: [trainer] {key}: not a trainer flag"
                              + (f" (did you mean {close[:3]}?)" if close else "")
                              + "; see hla-sp train --help")
        try:
            parse_args(flags_from_mapping({k: value}), raise_errors=True)
        except ConfigError as e:
            raise ConfigError(f"{path}: [trainer] {key} = {value!r}: {e}") from None


def flags_from_mapping(values: dict[str, Any]) -> list[str]:
    """``{"num_layers": 2, "recompute_activations": True}`` -> ``--num-layers 2 ...``;
    False gives ``--no-FLAG`` for flags that have that form (``hla_first_order``)."""
    negatable = {a.dest for a in _parser()._actions
                 if isinstance(a, argparse.BooleanOptionalAction)}
    argv: list[str] = []
    for key, v in values.items():
        flag = "--" + key.replace("_", "-")
        if v is True:
            argv.append(flag)
        elif v is False and key in negatable:
            argv.append("--no-" + flag[2:])
        elif v is False or v is None:
            continue
        elif isinstance(v, list):
            argv += [flag, *map(str, v)]
        else:
            argv += [flag, str(v)]
    return argv


_PARSER: list[argparse.ArgumentParser] = []


def _parser() -> argparse.ArgumentParser:
    if not _PARSER:
        _PARSER.append(build_parser())
    return _PARSER[0]


def point_config(sweep: dict[str, Any], world_size: int, seq_length: int) -> TrainConfig:
    """The trainer config of one grid point (CP over all P ranks unless set), parsed by the
    trainer's own parser so that every default, HLA flags included, is the CLI's."""
    base = {k.replace("-", "_"): v for k, v in sweep.get("trainer", {}).items()}
    base.setdefault("context_parallel_size", world_size)
    base["seq_length"] = seq_length
    base["train_iters"] = int(sweep.get("train_iters", 3))
    return parse_args(flags_from_mapping(base), raise_errors=True)


def check_resources(path: str, have: dict[str, float], need: int, use_gpu: bool,
                    where: str) -> None:
    """A CPU per worker (Ray Train's default) and a GPU each with use_gpu, for the
    largest world size; Ray would otherwise wait for them forever."""
    for res, key in (("CPU", "num_cpus"), *((("GPU", "num_gpus"),) if use_gpu else ())):
        if have.get(res, 0) < need:
            raise ConfigError(
                f"{path}: [ray] {key}: the {where} has {have.get(res, 0):g} {res}s, and the "
                f"largest world size in world_sizes needs {need} (one per worker); raise "
                f"{key} or drop the larger world sizes"
            )

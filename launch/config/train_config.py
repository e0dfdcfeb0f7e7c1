"""The trainer's configuration: :class:`TrainConfig`, a typed config in sections.

The sections (:mod:`hla_sp.launch.config.sections`, :mod:`hla_sp.launch.train.config`) are
dataclasses with one docstring per field, which is the flag's ``--help``; each checks
what it can alone (``validate``), and :func:`hla_sp.launch.checks.validate` checks them
against each other and the world size. ``hla`` is the typed
:class:`hla_sp.config.HLAConfig`, whose fields are the ``--hla-*`` flags.

Flags use Megatron-LM's spellings (``--num-layers``, ``--seq-length``,
``--context-parallel-size``, ...), one per field of every section. The HLA flags
(``--attention``, ``--hla-*``, ``--hla-layer-pattern``, ``--custom-import``) come from
:func:`hla_sp.megatron_patch.add_hla_args`, so the trainer and Megatron's own
``pretrain_gpt`` accept the same ones. A TOML file (``--config``) fills the same
sections: ``[model] num_layers = 2``, or flat keys as before.

``to_dict`` writes the sections (a checkpoint's ``config.json``); ``from_dict`` reads
them, or the flat form earlier versions wrote (every field at the top, the HLA flags in
an ``hla`` table by their argparse names), which :func:`flat_config` also gives.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from hla_sp.launch.checkpoint.config import CheckpointConfig
from hla_sp.launch.config.flags import (
    OneLineParser,
    RaisingParser,
    add_dataclass_flags,
    expand_config,
    field_docs,
    import_user_modules,
)
from hla_sp.launch.config.sections import Section
from hla_sp.launch.data.config import RECALL_FILLERS, DataConfig
from hla_sp.launch.distributed.config import ParallelismConfig

# The flag error, defined with the other known errors (the checks import this module,
# and this module imports no check: launch's modules form no circle).
from hla_sp.launch.errors import ConfigError
from hla_sp.launch.model.config import ModelConfig
from hla_sp.launch.train.config import (
    EvaluationConfig,
    LoggingConfig,
    OptimizerConfig,
    PerformanceConfig,
    PrecisionConfig,
)
from hla_sp.megatron_patch.args import add_hla_args, check_hla_options
from hla_sp.megatron_patch.hybrid import add_hybrid_args

from hla_sp.config import HLAConfig, hla_operator_names

__all__ = [
    "RECALL_FILLERS", "SECTIONS", "ConfigError", "TrainConfig", "add_hla_flags",
    "build_parser", "field_docs", "flag_names", "flat_config", "parse_args",
    "world_size_from_env",
]

# The sections, in --help's order; [name] in a TOML file, cfg.name in code.
SECTIONS: dict[str, type[Section]] = {
    "model": ModelConfig,
    "optimizer": OptimizerConfig,
    "precision": PrecisionConfig,
    "parallelism": ParallelismConfig,
    "data": DataConfig,
    "evaluation": EvaluationConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "performance": PerformanceConfig,
}
# Every section field -> its section (field names are unique across sections).
FIELD_SECTION: dict[str, str] = {
    f.name: name for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)  # type: ignore[arg-type]
}
# The model fields whose flags add_hla_args / add_hybrid_args define; the flat form
# kept them in its hla table, by these names.
_HLA_MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig)
                          if f.metadata.get("hla_flag"))


@dataclass
class TrainConfig:
    """Everything ``hla_sp.launch.train`` needs, in sections; each field of a section is
    the flag ``--field-name``, and ``hla``'s are ``--hla-field-name``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    data: DataConfig = field(default_factory=DataConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    performance: PerformanceConfig = field(default_factory=PerformanceConfig)
    hla: HLAConfig = field(default_factory=HLAConfig)
    """The HLA options; ``hla.operator`` follows ``model.attention`` when that is an HLA
    operator (under softmax they are unused)."""

    def __post_init__(self) -> None:
        if self.model.attention in hla_operator_names() and (
                self.hla.operator != self.model.attention):
            try:
                self.hla = self.hla.replace(operator=self.model.attention)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"--attention {self.model.attention}: {e}") from None

    def sections(self) -> Iterator[tuple[str, Section]]:
        """(name, section) of every section but ``hla``, in --help's order."""
        for name in SECTIONS:
            yield name, getattr(self, name)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes``: fields by their flat names (``seq_length=128``), or whole
        sections (``model=...``, ``hla=...``)."""
        by_section: dict[str, dict[str, Any]] = {}
        whole = {k: v for k, v in changes.items() if k in SECTIONS or k == "hla"}
        for k, v in changes.items():
            if k in whole:
                continue
            if k not in FIELD_SECTION:
                raise ConfigError(f"unknown config field {k!r}")
            by_section.setdefault(FIELD_SECTION[k], {})[k] = v
        new = {name: dataclasses.replace(whole.get(name, sec), **by_section.get(name, {}))
               for name, sec in self.sections()}
        return TrainConfig(**new, hla=whole.get("hla", self.hla))

    def hla_flags(self) -> dict[str, Any]:
        """The HLA flags as add_hla_args parses them (``attention``, ``hla_decay``, ...):
        what :func:`hla_sp.megatron_patch.check_hla_args` and the layer specs read."""
        m = self.model
        return {"attention": m.attention, "custom_import": list(m.custom_import),
                **{"hla_" + f.name: getattr(self.hla, f.name) for f in HLAConfig.flag_fields()},
                "hla_layer_pattern": m.hla_layer_pattern}

    def flat(self) -> dict[str, Any]:
        """The flat form earlier versions saved: every section field at the top, the HLA
        flags in ``hla`` by their argparse names."""
        out: dict[str, Any] = {}
        for _, sec in self.sections():
            out.update({k: v for k, v in sec.to_dict().items() if k not in _HLA_MODEL_FIELDS})
        return {**out, "hla": self.hla_flags()}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly copy in sections (what checkpoints and Ray workers carry)."""
        out = {name: sec.to_dict() for name, sec in self.sections()}
        out["hla"] = {f.name: getattr(self.hla, f.name) for f in HLAConfig.flag_fields()}
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`; also reads the flat form of earlier versions.
        Unknown keys are an error naming them."""
        if not is_sectioned(d):
            return cls._from_flat(d)
        unknown = set(d) - set(SECTIONS) - {"hla"}
        if unknown:
            raise ConfigError(f"unknown config sections {sorted(unknown)}; known: "
                              f"{[*SECTIONS, 'hla']}")
        kw = {name: _section(sc, d.get(name) or {}, name) for name, sc in SECTIONS.items()}
        hla = dict(d.get("hla") or {})
        hla.pop("operator", None)  # model.attention says which
        return cls(**kw, hla=_section(HLAConfig, hla, "hla"))

    @classmethod
    def _from_flat(cls, d: dict[str, Any]) -> TrainConfig:
        flat = dict(d)
        hla = dict(flat.pop("hla", None) or {})
        unknown = set(flat) - set(FIELD_SECTION) - set(_HLA_MODEL_FIELDS)
        if unknown:
            raise ConfigError(f"unknown config keys {sorted(unknown)}; known: "
                              f"{sorted([*FIELD_SECTION, 'hla'])}")
        # before sections, a config without the key meant softmax
        flat["attention"] = hla.pop("attention", "softmax")
        for k in ("custom_import", "hla_layer_pattern"):
            if k in hla:
                flat[k] = hla.pop(k)
        own = {f.name for f in dataclasses.fields(HLAConfig)}
        bad = [k for k in hla if not k.startswith("hla_") or k[4:] not in own]
        if bad:
            raise ConfigError(f"unknown keys {sorted(bad)} in the config's hla table")
        return cls.from_dict({
            **{name: {k: v for k, v in flat.items() if FIELD_SECTION.get(k) == name}
               for name in SECTIONS},
            "hla": {k[4:]: v for k, v in hla.items()}})


def _section(cls: type, values: dict[str, Any], name: str) -> Any:
    """``cls(**values)``; an unknown key or a bad value is a ConfigError naming it."""
    if not isinstance(values, dict):
        raise ConfigError(f"config section {name!r}: expected an object, got {values!r:.60}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"unknown keys {sorted(unknown)} in config section {name!r}; "
                          f"known: {sorted(known)}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config section {name!r}: {e}") from None


def is_sectioned(d: dict[str, Any]) -> bool:
    """Whether a saved config is in sections (this version) or flat (earlier ones)."""
    return any(isinstance(d.get(name), dict) for name in SECTIONS)


def flat_config(d: dict[str, Any]) -> dict[str, Any]:
    """A saved config (sections or flat) in the flat form :meth:`TrainConfig.flat`
    gives, without building it: keys this version does not know are kept."""
    if not is_sectioned(d):
        return d
    out: dict[str, Any] = {}
    hla: dict[str, Any] = {}
    for name, sec in d.items():
        if name == "hla" and isinstance(sec, dict):
            hla.update({"hla_" + k: v for k, v in sec.items()})
        elif isinstance(sec, dict):
            for k, v in sec.items():
                (hla if k in _HLA_MODEL_FIELDS else out)[k] = v
        else:
            out[name] = sec
    return {**out, "hla": hla}


# Megatron spells a few flags half with underscores; both spellings are accepted.
_MEGATRON_SPELLINGS = {
    "override_opt_param_scheduler": ("--override-opt_param-scheduler",),
    "use_checkpoint_opt_param_scheduler": ("--use-checkpoint-opt_param-scheduler",),
}


def add_hla_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--attention`` and the ``--hla-*`` flags from the Megatron drop-in."""
    add_hla_args(parser)
    add_hybrid_args(parser)  # --hla-layer-pattern: HLA in some layers, softmax in the rest
    # The trainer exists to train HLA; Megatron's own entry point keeps softmax as default.
    parser.set_defaults(attention=ModelConfig.attention)


def build_parser(
    prog: str = "hla_sp.launch.train", raise_errors: bool = False
) -> argparse.ArgumentParser:
    """The trainer's argument parser, generated from :class:`TrainConfig`'s sections, a
    group each in --help; ``parser.sections`` maps each section to its destinations
    (what a TOML table of that name may hold)."""
    parser = (RaisingParser if raise_errors else OneLineParser)(
        prog=prog,
        description="Train a megatron-core GPT with HLA attention and context parallelism.",
        allow_abbrev=False,  # as Megatron's parser: no prefix surprises between flags
    )
    parser.add_argument(
        "--config", metavar="TOML", default=None, action="append",
        help="Read trainer flags from this TOML file: a table per section ([model] "
             "num_layers = 2; [hla] decay = 'data'), or keys by flag name at the top or "
             "in any other table (seq_length = 4096), a key given once. Several --config "
             "files merge in order, the later winning; flags on the command line win over "
             "all of them.",
    )
    sections = {name: add_dataclass_flags(parser, name, cls, _MEGATRON_SPELLINGS)
                for name, cls in SECTIONS.items()}
    add_hla_flags(parser)
    sections["hla"] = ["hla_" + f.name for f in HLAConfig.flag_fields()]
    parser.sections = sections  # type: ignore[attr-defined]
    return parser


def config_from_flags(ns: dict[str, Any]) -> TrainConfig:
    """The config of parsed flags (argparse's destinations, ``hla_decay`` ...): the one
    place the run's :class:`HLAConfig` is built; it passes whole from here on."""
    kw = {name: _section(cls, {f.name: ns[f.name] for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                               if f.name in ns}, name)
          for name, cls in SECTIONS.items()}
    attention = kw["model"].attention
    try:  # the Megatron drop-in's check first, once: its message names the flag
        check_hla_options(attention, {k[4:]: v for k, v in ns.items() if k.startswith("hla_")})
    except ValueError as e:
        raise ConfigError(str(e)) from None
    operator = attention if attention in hla_operator_names() else HLAConfig.operator
    try:
        hla = HLAConfig.from_flags(ns, operator=operator)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config section 'hla': {e}") from None
    return TrainConfig(**kw, hla=hla)


def parse_args(
    argv: list[str] | None = None, raise_errors: bool = False, prog: str = "hla_sp.launch.train"
) -> TrainConfig:
    """Parse trainer flags (and ``--config`` TOML files) into a :class:`TrainConfig`;
    with ``raise_errors`` a bad flag raises :class:`ConfigError` instead of exiting with
    one line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # The user's modules first (in the launcher and in every worker): the operators
        # they register are --attention's choices, so they must exist before any parser.
        import_user_modules(argv)
        argv = expand_config(argv, lambda: build_parser(prog, raise_errors=True))
        import_user_modules(argv)  # and those a --config file names
    except ConfigError as e:
        if raise_errors:
            raise
        sys.exit(f"{prog}: error: {e}")
    ns = vars(build_parser(prog, raise_errors=raise_errors).parse_args(argv))
    ns.pop("config", None)
    try:
        return config_from_flags(ns)
    except ConfigError as e:
        if raise_errors:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)


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

"""Command-line flags for HLA in Megatron-LM: ``add_hla_args`` is an extra_args_provider.

``--attention softmax`` (the default) leaves Megatron untouched. The flags live beside
Megatron's own ``--attention-backend`` and ``--attention-dropout``: Megatron's parser
has ``allow_abbrev=False``, so ``--attention`` is matched exactly and is never read as
an abbreviation of either (and argparse prefers an exact match anyway).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from typing import Any

from hla_sp.config import HLAConfig, hla_operator_names, operator_facts


def attention_choices() -> tuple[str, ...]:
    """``--attention``'s choices now: softmax, the higher-order built-ins, and the
    operators that modules imported by ``--custom-import`` registered."""
    return ("softmax", *hla_operator_names())


def attention_name(name: str) -> str:
    """``--attention``'s type: a first-order operator of the table is refused with why (the
    choices check then names the valid ones for any other name)."""
    facts = operator_facts().get(name)
    if facts is not None and not facts.higher_order:
        raise argparse.ArgumentTypeError(
            f"{name!r} is a first-order operator (its OperatorSpec has higher_order=False), "
            f"and the core-attention slot takes only higher-order ones: "
            f"{', '.join(hla_operator_names())}")
    return name


def custom_imports(argv: Sequence[str]) -> list[str]:
    """The modules ``argv`` names with ``--custom-import MODULE`` (or ``=MODULE``), in
    order; read before any parser is built, since their operators decide the choices."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--custom-import":
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                raise ValueError("--custom-import: expected a module name, got nothing")
            out.append(argv[i + 1])
            i += 2
            continue
        if a.startswith("--custom-import="):
            out.append(a.split("=", 1)[1])
        i += 1
    return out


def import_custom(modules: Sequence[str]) -> None:
    """Import the user's modules (each registers its operators with
    ``hla_sp.ops.operators.register``); a module that fails is one ValueError naming it."""
    for name in modules:
        try:
            importlib.import_module(name)
        except SystemExit as e:  # sys.exit() at import: not a silent end of the run
            raise ValueError(f"--custom-import {name}: the module called sys.exit({e.code!r}) "
                             f"while being imported; a module that registers operators "
                             f"must not exit") from None
        except Exception as e:  # the user's code: whatever it raises, name the module
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ValueError(f"--custom-import {name}: cannot import it "
                             f"({type(e).__name__}: {first})") from None

def add_hla_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the HLA flags to ``parser`` and return it (Megatron's extra_args_provider).

    Raises:
        ValueError: if the parser already defines one of the flags.
    """
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(f"parser: expected an argparse.ArgumentParser, got "
                        f"{type(parser).__name__}")
    flags = ["--attention", "--custom-import"] + [
        f"--{p}hla-{f.name.replace('_', '-')}" for f in HLAConfig.flag_fields()
        for p in (("", "no-") if isinstance(f.default, bool) else ("",))
    ]
    taken = [f for f in flags if f in parser._option_string_actions]
    if taken:
        raise ValueError(f"parser: the HLA flags {taken} are already defined by this parser; "
                         "add_hla_args must be called once, on a parser without them")
    g = parser.add_argument_group("HLA", "Higher-order linear attention (hla_sp)")
    hla = ", ".join(hla_operator_names())
    g.add_argument("--attention", type=attention_name, choices=attention_choices(),
                   default="softmax",
                   help=f"Core attention: softmax leaves Megatron as it is; {hla} put HLA in "
                        "the core-attention slot of every layer (an operator registered by a "
                        "--custom-import module too).")
    g.add_argument("--custom-import", action="append", default=[], metavar="MODULE",
                   help="Import this module first, in the launcher and in every worker, "
                        "before the flags are checked: the operators it registers "
                        "(hla_sp.ops.operators.register) are then accepted by --attention, "
                        "the layer specs and the checkpoints. May be given several times; "
                        "the run records it, so a resume or generate imports it again.")
    HLAConfig.add_flags(g)  # --hla-decay, --hla-normalize, ...: choices and defaults from there
    return parser


def hla_enabled(args: Any) -> bool:
    """Whether ``args`` asks for HLA attention."""
    return getattr(args, "attention", "softmax") != "softmax"


def hla_spec_kwargs(args: Any) -> dict[str, Any]:
    """Keyword arguments of ``get_hla_layer_*_spec`` from parsed flags."""
    if not hla_enabled(args):
        raise ValueError(f"args.attention: expected one of {hla_operator_names()}, got "
                         "'softmax'")
    cfg = HLAConfig.from_flags(args, operator=args.attention)
    return {f.name: getattr(cfg, f.name) for f in HLAConfig.flag_fields()} | {
        "operator": cfg.operator}


def check_hla_args(args: Any) -> None:
    """Refuse the flag combinations under which Megatron would silently drop HLA.

    Raises:
        ValueError: ``--attention-backend local`` with HLA (newer GPT builders overwrite
            the core-attention slot with DotProductAttention); ``--spec`` with HLA (the
            entry point sets the layer spec itself); an option only other operators take
            (hla2's --hla-normalize, --hla-ridge) with ahla/hla3.
    """
    if not hla_enabled(args):
        return
    backend = getattr(args, "attention_backend", None)
    name = getattr(backend, "name", backend)
    if name is not None and str(name).lower() == "local":
        raise ValueError(
            f"--attention-backend local with --attention {args.attention}: Megatron replaces "
            "the core attention by DotProductAttention under 'local', so HLA would not run. "
            "Leave --attention-backend at its default (auto)."
        )
    spec = getattr(args, "spec", None)
    if spec:
        raise ValueError(
            f"--spec {' '.join(spec)} with --attention {args.attention}: the entry point "
            "builds the HLA layer spec itself; drop --spec (or use --attention softmax)."
        )
    check_hla_options(args.attention, {f.name: getattr(args, "hla_" + f.name)
                                       for f in HLAConfig.flag_fields()
                                       if hasattr(args, "hla_" + f.name)})


def check_hla_options(attention: str, options: Any) -> None:
    """Refuse an option only other operators take (hla2's normalize and ridge, as the
    operators' facts say), set away from its default with ``--attention attention``.

    ``options``: an :class:`hla_sp.config.HLAConfig` (the trainer's, whole) or a mapping
    of its flag fields' values.

    Raises:
        ValueError: naming the flag, the operators that take it and ``attention``.
    """
    if attention == "softmax":
        return
    facts, defaults = operator_facts(), HLAConfig()
    for f in HLAConfig.flag_fields():
        takers = [n for n, fact in facts.items() if f.name in fact.options]
        default = getattr(defaults, f.name)
        value = (options.get(f.name, default) if isinstance(options, dict)
                 else getattr(options, f.name))
        if takers and attention not in takers and value != default:
            raise ValueError(f"--hla-{f.name.replace('_', '-')}: {'/'.join(takers)} only, got "
                             f"--attention {attention}")

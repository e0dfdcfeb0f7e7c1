"""Command-line flags for HLA in Megatron-LM: ``add_hla_args`` is an extra_args_provider.

``--attention softmax`` (the default) leaves Megatron untouched. The flags live beside
Megatron's own ``--attention-backend`` and ``--attention-dropout``: Megatron's parser
has ``allow_abbrev=False``, so ``--attention`` is matched exactly and is never read as
an abbreviation of either (and argparse prefers an exact match anyway).
"""

from __future__ import annotations

import argparse
from typing import Any

ATTENTION_CHOICES = ("softmax", "hla2", "ahla", "hla3")
DECAY_CHOICES = ("none", "fixed", "learned", "data")
SP_METHOD_CHOICES = ("allgather", "ring", "tree")
# Kept equal to hla_sp.nn.DEFAULT_DECAY and DEFAULT_CHUNK_SIZE (a test checks it);
# repeated so that parsing flags needs no torch import.
DEFAULT_DECAY = "learned"
DEFAULT_CHUNK_SIZE = 64

_FLAGS = ("--attention", "--hla-decay", "--hla-normalize", "--no-hla-normalize",
          "--hla-ridge", "--hla-chunk-size", "--hla-sp-method")


def _power_of_two(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a power of two, got {text!r}") from None
    if n < 1 or n & (n - 1):
        raise argparse.ArgumentTypeError(f"expected a power of two, got {n}")
    return n


def _nonneg_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a float >= 0, got {text!r}") from None
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"expected a float >= 0, got {x}")
    return x


def add_hla_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the HLA flags to ``parser`` and return it (Megatron's extra_args_provider).

    Raises:
        ValueError: if the parser already defines one of the flags.
    """
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(f"parser: expected an argparse.ArgumentParser, got "
                        f"{type(parser).__name__}")
    taken = [f for f in _FLAGS if f in parser._option_string_actions]
    if taken:
        raise ValueError(f"parser: the HLA flags {taken} are already defined by this parser; "
                         "add_hla_args must be called once, on a parser without them")
    g = parser.add_argument_group("HLA", "Higher-order linear attention (hla_sp)")
    g.add_argument("--attention", choices=ATTENTION_CHOICES, default="softmax",
                   help="Core attention: softmax leaves Megatron as it is; hla2, ahla, hla3 put "
                        "HLA in the core-attention slot of every layer.")
    g.add_argument("--hla-decay", choices=DECAY_CHOICES, default=DEFAULT_DECAY,
                   help="HLA decay: none, fixed (RetNet schedule), learned (per head), "
                        "data (per token gate).")
    g.add_argument("--hla-normalize", action=argparse.BooleanOptionalAction, default=False,
                   help="hla2 only: divide by the paper's normaliser (can be near zero).")
    g.add_argument("--hla-ridge", type=_nonneg_float, default=0.0,
                   help="hla2 only: lambda of S + lambda I.")
    g.add_argument("--hla-chunk-size", type=_power_of_two, default=DEFAULT_CHUNK_SIZE,
                   help="Chunk length of the chunk-parallel path (a power of two).")
    g.add_argument("--hla-sp-method", choices=SP_METHOD_CHOICES, default="allgather",
                   help="Exchange of the segment summaries across the context-parallel group.")
    return parser


def hla_enabled(args: Any) -> bool:
    """Whether ``args`` asks for HLA attention."""
    return getattr(args, "attention", "softmax") != "softmax"


def hla_spec_kwargs(args: Any) -> dict[str, Any]:
    """Keyword arguments of ``get_hla_layer_*_spec`` from parsed flags."""
    if not hla_enabled(args):
        raise ValueError("args.attention: expected one of hla2, ahla, hla3, got 'softmax'")
    return dict(operator=args.attention, decay=args.hla_decay, normalize=args.hla_normalize,
                ridge=args.hla_ridge, chunk_size=args.hla_chunk_size,
                sp_method=args.hla_sp_method)


def check_hla_args(args: Any) -> None:
    """Refuse the flag combinations under which Megatron would silently drop HLA.

    Raises:
        ValueError: ``--attention-backend local`` with HLA (newer GPT builders overwrite
            the core-attention slot with DotProductAttention); ``--spec`` with HLA (the
            entry point sets the layer spec itself); hla2-only options with ahla/hla3.
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
    if args.attention != "hla2" and (args.hla_normalize or args.hla_ridge):
        raise ValueError(f"--hla-normalize/--hla-ridge: hla2 only, got --attention "
                         f"{args.attention}")

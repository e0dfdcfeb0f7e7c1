"""Megatron flags under which HLA would be ignored or bypassed without a word: refused.

Each of these either builds attention that is not HLA beside (or instead of) the HLA
layers, or asks for a softmax variant that HLA cannot honour. :func:`refuse_bypasses`
raises before anything is built, naming the flag and why; the entry point calls it on
its pre-scan of the command line and again on Megatron's parsed arguments.

=================================  ==================================================
flag                               why it is refused with HLA
=================================  ==================================================
``--mtp-num-layers N``             the multi-token-prediction layers are built from
                                   Megatron's softmax layer spec, not ours
``--use-legacy-models``            the legacy GPT model never reads a layer spec: it
                                   trains softmax attention
``--multi-latent-attention``       MLA replaces SelfAttention; an HLA spec has no MLA
                                   variant, so the flag would silently do nothing
``--experimental-attention-var..`` Megatron builds its own attention variant there,
                                   in place of the layer spec
``--linear-attention-freq``        the pattern of Megatron's own linear attention;
                                   the HLA/softmax pattern is ``--hla-layer-pattern``
``--use-kitchen-attention``        Kitchen's attention would replace the core slot
``--softmax-type`` not vanilla     HLA has no softmax to give an off-by-one or
                                   learnable sink to
=================================  ==================================================
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


class BypassError(ValueError):
    """A flag under which the HLA the user asked for would not (all) run."""


def add_bypass_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags :func:`refuse_bypasses` reads, for a pre-scan before Megatron parses."""
    parser.add_argument("--mtp-num-layers", type=int, default=None)
    parser.add_argument("--use-legacy-models", action="store_true")
    parser.add_argument("--multi-latent-attention", action="store_true")
    parser.add_argument("--experimental-attention-variant", default=None)
    parser.add_argument("--linear-attention-freq", default=None)
    parser.add_argument("--use-kitchen-attention", action="store_true")
    parser.add_argument("--softmax-type", default="vanilla")
    return parser


def refuse_bypasses(args: Any, route: str) -> None:
    """Raise :class:`BypassError` for the first flag in ``args`` that HLA would not honour.

    Args:
        args: a namespace with Megatron's attribute names (missing ones count as unset).
        route: how HLA was asked for, quoted in the message (``--attention hla2``, or
            ``--spec MODULE NAME``).
    """
    mtp = getattr(args, "mtp_num_layers", None)
    if mtp:
        raise BypassError(
            f"--mtp-num-layers {mtp} with {route}: Megatron builds the multi-token-prediction "
            "layers from its own softmax layer spec, so they would not run HLA (and the loss "
            "shapes differ). Drop --mtp-num-layers.")
    if getattr(args, "use_legacy_models", False):
        raise BypassError(
            f"--use-legacy-models with {route}: the legacy GPT model never reads a layer spec "
            "and trains softmax attention. Drop --use-legacy-models (megatron-core models).")
    if getattr(args, "multi_latent_attention", False):
        raise BypassError(
            f"--multi-latent-attention with {route}: the HLA layer spec has no MLA variant, so "
            "the flag would be silently ignored. Drop it.")
    variant = getattr(args, "experimental_attention_variant", None)
    if variant:
        raise BypassError(
            f"--experimental-attention-variant {variant} with {route}: Megatron would build its "
            "own attention variant in place of the HLA layer spec. Drop it.")
    freq = getattr(args, "linear_attention_freq", None)
    if freq is not None:
        raise BypassError(
            f"--linear-attention-freq {freq} with {route}: that is the layer pattern of "
            "Megatron's own linear attention and does nothing here. Put HLA in some layers "
            "and softmax in the rest with --hla-layer-pattern (same syntax).")
    if getattr(args, "use_kitchen_attention", False):
        raise BypassError(
            f"--use-kitchen-attention with {route}: Kitchen's attention would take the "
            "core-attention slot, or be ignored. Drop it.")
    softmax_type = getattr(args, "softmax_type", "vanilla")
    if softmax_type not in (None, "vanilla"):
        raise BypassError(
            f"--softmax-type {softmax_type} with {route}: HLA has no softmax to change, so it "
            "would be ignored in every HLA layer. Use the default (vanilla).")


def refuse_bypasses_at_spec_import(module: str) -> None:
    """Run :func:`refuse_bypasses` when Megatron-LM's own script imports ``--spec module``.

    Megatron parses its flags before its model_provider imports the ``--spec`` module, so
    the parsed flags are there to read; its importer catches only ImportError, so the
    BypassError (a ValueError) stops the run. Elsewhere (no parsed Megatron flags, or a
    ``--spec`` naming another module) this does nothing.
    """
    gv = sys.modules.get("megatron.training.global_vars")
    args = getattr(gv, "_GLOBAL_ARGS", None) if gv is not None else None
    spec = getattr(args, "spec", None)
    if args is None or not spec or spec[0] != module:
        return
    route = "--spec " + " ".join(map(str, spec))
    refuse_bypasses(args, route)
    if getattr(args, "reset_attention_mask", False):
        # Megatron's script hands HLA only its [b, 1, s, s] mask, which HLA cannot read
        raise BypassError(
            f"--reset-attention-mask with {route}: expected HLA's entry point (python -m "
            "hla_sp.megatron_patch.pretrain_gpt), which cuts the documents at the EOD tokens; "
            "got Megatron-LM's own script, whose HLA layers would see across documents")

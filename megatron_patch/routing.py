"""How the drop-in's flags route to a layer, read before and after Megatron parses them.

:func:`prescan` reads the flags that decide the layer before Megatron parses anything;
:func:`hla_route` says how HLA was asked for (``--attention`` or a ``--spec`` whose
core attention is HLA's); :func:`check_args` holds the refusals under which HLA would
silently not run; :func:`layer_spec_from_args` picks the layer (or hybrid block) spec.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from typing import Any

from hla_sp.megatron_patch.args import add_hla_args, check_hla_args, hla_enabled, hla_spec_kwargs
from hla_sp.megatron_patch.guards import add_bypass_flags, refuse_bypasses
from hla_sp.megatron_patch.hybrid import (
    add_hybrid_args,
    check_hybrid_parallel,
    hybrid_block_spec,
    layer_pattern,
)


def extra_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's extra_args_provider: the HLA flags and ``--hla-layer-pattern``."""
    return add_hybrid_args(add_hla_args(parser))


def prescan(argv: Sequence[str]) -> argparse.Namespace:
    """Read the flags that decide the layer before Megatron parses anything.

    Raises:
        ValueError: a combination under which HLA would silently not run.
    """
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    extra_args(p)
    add_bypass_flags(p)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--spec", nargs="*", default=None)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--transformer-impl", default="transformer_engine")
    p.add_argument("--reset-attention-mask", action="store_true")
    try:
        ns, _ = p.parse_known_args(list(argv))
    except SystemExit:  # a bad value of one of our flags: argparse has printed why
        raise ValueError("see the message above") from None
    check_hla_args(ns)
    check_args(ns, hla_route(ns))
    return ns


def hla_route(args: Any, user_spec: Any = None) -> str | None:
    """How HLA was asked for (quoted in refusals), or None for plain softmax."""
    if hla_enabled(args):
        return f"--attention {args.attention}"
    if user_spec is not None and expects_hla(user_spec):
        return "--spec " + " ".join(args.spec)
    return None


def _use_te(args: Any) -> bool:
    from hla_sp.megatron_patch.specs import te_available

    return getattr(args, "transformer_impl", "local") == "transformer_engine" and te_available()


def check_args(args: Any, route: str | None) -> None:
    """The refusals that need all of Megatron's flags (pre-scan and parsed alike)."""
    if route is None:
        if getattr(args, "hla_layer_pattern", None) is not None:
            raise ValueError("--hla-layer-pattern needs --attention hla2|ahla|hla3")
        return
    refuse_bypasses(args, route)
    check_reset_attention_mask(args, route)
    freq = getattr(args, "hla_layer_pattern", None)
    if freq is not None:
        if not hla_enabled(args):
            raise ValueError(f"--hla-layer-pattern with {route}: use --attention instead")
        if args.num_layers is None:
            raise ValueError("--hla-layer-pattern needs --num-layers")
        pattern = layer_pattern(freq, args.num_layers)
        check_hybrid_parallel(
            pattern, context_parallel_size=args.context_parallel_size,
            pipeline_parallel_size=args.pipeline_model_parallel_size,
            use_te=args.context_parallel_size > 1 and _use_te(args))


def check_reset_attention_mask(args: Any, route: str) -> None:
    """``--reset-attention-mask`` reaches HLA as documents cut at the EODs
    (:mod:`hla_sp.megatron_patch.documents`); refuse where they cannot reach it."""
    if not getattr(args, "reset_attention_mask", False):
        return
    freq = getattr(args, "hla_layer_pattern", None)
    if freq is not None:
        raise ValueError(
            f"--reset-attention-mask with {route} --hla-layer-pattern {freq}: expected HLA in "
            "every layer (the documents reach HLA as packed_seq_params, which megatron-core's "
            "softmax DotProductAttention refuses), got a hybrid stack")
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if pp > 1:
        raise ValueError(
            f"--reset-attention-mask with {route}: expected --pipeline-model-parallel-size 1 "
            f"(the documents are cut at the EOD tokens, which the middle stages do not "
            f"have), got {pp}")


def resolve_spec(spec: Sequence[str]) -> Any:
    """Import ``--spec MODULE NAME`` loudly (Megatron's importer hides ImportError)."""
    if len(spec) != 2:
        raise ValueError(f"--spec: expected MODULE NAME, got {list(spec)}")
    module, name = spec
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(
            f"--spec {module} {name}: the module does not import ({type(e).__name__}: {e}). "
            "Megatron would log this and silently build the default softmax spec."
        ) from e
    if not hasattr(mod, name):
        raise ValueError(f"--spec {module} {name}: {module} has no attribute {name!r}")
    return getattr(mod, name)


def expects_hla(spec: Any) -> bool:
    from hla_sp.megatron_patch.specs import is_hla_builder

    attn = getattr(getattr(spec, "submodules", None), "self_attention", None)
    core = getattr(getattr(attn, "submodules", None), "core_attention", None)
    return core is not None and is_hla_builder(core)


def layer_spec_from_args(args: Any, user_spec: Any = None) -> Any:
    """The transformer-layer spec the flags ask for (a block spec for a hybrid stack)."""
    from hla_sp.megatron_patch.specs import get_hla_layer_spec

    use_te = _use_te(args)
    megatron_kwargs: dict[str, Any] = dict(
        num_experts=getattr(args, "num_experts", None),
        moe_grouped_gemm=getattr(args, "moe_grouped_gemm", False),
        qk_layernorm=getattr(args, "qk_layernorm", False),
    )
    if not use_te:
        megatron_kwargs["normalization"] = getattr(args, "normalization", None)
    from megatron.core.models.gpt import gpt_layer_specs

    def softmax_spec() -> Any:
        if use_te:
            return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**megatron_kwargs)
        return gpt_layer_specs.get_gpt_layer_local_spec(**megatron_kwargs)

    if hla_enabled(args):
        hla = get_hla_layer_spec(use_te=use_te, **hla_spec_kwargs(args), **megatron_kwargs)
        freq = getattr(args, "hla_layer_pattern", None)
        if freq is None:
            return hla
        return hybrid_block_spec(layer_pattern(freq, args.num_layers), hla, softmax_spec())
    if user_spec is not None:
        return user_spec
    return softmax_spec()

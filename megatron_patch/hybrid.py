"""Hybrid stacks: HLA in a chosen subset of layers, softmax attention in the rest.

``--hla-layer-pattern`` reads exactly like Megatron's ``--linear-attention-freq``
(1 = a linear-attention layer, here HLA; 0 = a softmax layer):

* an integer N: every N-th layer is softmax, the others HLA. Layer i (0-based) is
  softmax when ``(i + 1) % N == 0``: N = 4 on 8 layers gives ``[1,1,1,0,1,1,1,0]``;
* a Python list expression of 0s and 1s, one per layer, for example
  ``"([1]*3+[0]*1)*3"`` (12 layers) or ``"[0]+[1]*23"`` (softmax first, then HLA).
  Only digits, commas, brackets, parentheses, ``+`` and ``*`` are accepted.

A pattern without any HLA layer is refused (that is ``--attention softmax``).

At context parallelism > 1 the softmax layers need Transformer Engine's
context-parallel attention (megatron-core's local DotProductAttention has none): the
hybrid spec takes both layer kinds from the TE spec where TE imports and
``--transformer-impl transformer_engine`` is set, and is refused otherwise. Pipeline
parallelism is refused with a pattern (the per-stage slice of the pattern is not done).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

_ALLOWED = re.compile(r"^[\d,\[\]\(\)\+\*\s]+$")


def parse_layer_pattern(text: str | int | list[int] | None) -> int | list[int] | None:
    """``--hla-layer-pattern``'s value: an int N or the list a pattern expression makes.

    Raises:
        argparse.ArgumentTypeError: anything else (an expression with other characters,
            N < 1, entries other than 0 and 1).
    """
    if text is None or isinstance(text, (int, list)):
        value: Any = text
    else:
        s = str(text).strip()
        if not s or not _ALLOWED.match(s):
            raise argparse.ArgumentTypeError(
                f"expected an integer N or a list expression such as '([1]*3+[0])*2' "
                f"(digits , [ ] ( ) + * only), got {text!r}")
        if "[" in s:
            try:
                # Safe: only digits, commas, brackets, parentheses, + and * got here.
                value = eval(s, {"__builtins__": {}}, {})
            except Exception as e:
                raise argparse.ArgumentTypeError(f"{text!r} does not evaluate: {e}") from None
        else:
            try:
                value = int(s)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected an integer N, got {text!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, list)):
        raise argparse.ArgumentTypeError(f"expected an int or a list, got {value!r}")
    if isinstance(value, int) and value < 1:
        raise argparse.ArgumentTypeError(f"expected N >= 1, got {value}")
    if isinstance(value, list) and (not value or any(x not in (0, 1) or isinstance(x, bool)
                                                     for x in value)):
        raise argparse.ArgumentTypeError(f"expected a non-empty list of 0 and 1, got {value!r}")
    return value


def add_hybrid_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--hla-layer-pattern`` to ``parser`` (beside :func:`add_hla_args`'s flags)."""
    parser.add_argument(
        "--hla-layer-pattern", type=parse_layer_pattern, default=None,
        help="Which layers run HLA (1) and which softmax (0), as Megatron's "
             "--linear-attention-freq: an int N (every N-th layer softmax) or a list "
             "expression such as '([1]*3+[0])*2'. Default: every layer HLA.")
    return parser


def layer_pattern(freq: int | list[int] | str, num_layers: int) -> list[int]:
    """The per-layer pattern (1 = HLA, 0 = softmax) of ``num_layers`` layers.

    Raises:
        ValueError: a list of the wrong length, or a pattern with no HLA layer.
    """
    value = parse_layer_pattern(freq) if isinstance(freq, str) else freq
    if isinstance(value, int):
        pattern = [0 if (i + 1) % value == 0 else 1 for i in range(num_layers)]
    else:
        pattern = list(value)  # type: ignore[arg-type]
        if len(pattern) != num_layers:
            raise ValueError(f"--hla-layer-pattern {freq}: {len(pattern)} entries for "
                             f"--num-layers {num_layers}; give one 0/1 per layer")
    if not any(pattern):
        raise ValueError(f"--hla-layer-pattern {freq}: no layer runs HLA on {num_layers} "
                         "layers (N = 1 makes every layer softmax); use --attention softmax, "
                         "or a pattern with 1s")
    return pattern


def check_hybrid_parallel(pattern: list[int], *, context_parallel_size: int,
                          pipeline_parallel_size: int = 1, use_te: bool) -> None:
    """Refuse the parallel layouts a hybrid stack cannot run (before anything is built).

    Raises:
        ValueError: softmax layers at CP > 1 without Transformer Engine; PP > 1.
    """
    if pipeline_parallel_size > 1 and not all(pattern):
        raise ValueError(
            f"--hla-layer-pattern with --pipeline-model-parallel-size {pipeline_parallel_size}:"
            " not supported yet (each stage would need its slice of the pattern)")
    if context_parallel_size > 1 and not all(pattern) and not use_te:
        raise ValueError(
            f"--hla-layer-pattern with --context-parallel-size {context_parallel_size}: the "
            f"{pattern.count(0)} softmax layer(s) need Transformer Engine's context-parallel "
            "attention, and Transformer Engine is not in use here (it does not import, or "
            "--transformer-impl is not transformer_engine). Install TE and pass "
            "--transformer-impl transformer_engine, run at CP = 1, or make every layer HLA.")


def hybrid_block_spec(pattern: list[int], hla_layer_spec: Any, softmax_layer_spec: Any) -> Any:
    """A TransformerBlock spec with ``hla_layer_spec`` where the pattern says 1.

    The final norm is the one megatron-core gives a block built from a single layer
    spec, so an all-HLA pattern builds the same model as the plain HLA spec.
    """
    from megatron.core.transformer import transformer_block as tb

    specs = [hla_layer_spec if p else softmax_layer_spec for p in pattern]
    return tb.TransformerBlockSubmodules(layer_specs=specs, layer_norm=tb.LayerNormImpl)


def assert_hybrid_model(model: Any, pattern: list[int], operator: str | None = None) -> dict:
    """Raise RuntimeError unless layer i runs HLA exactly where ``pattern[i]`` is 1.

    Returns:
        {layer index: "hla2"/"ahla"/"hla3" or the softmax class name}.
    """
    from hla_sp.megatron_patch.core_attention import HLACoreAttention
    from torch import nn

    chunks = model if isinstance(model, (list, tuple)) else [model]
    found: dict[int, str] = {}
    problems = []
    for chunk in chunks:
        if not isinstance(chunk, nn.Module):
            raise TypeError(f"model: expected an nn.Module or a list of them, got "
                            f"{type(chunk).__name__}")
        for _, m in chunk.named_modules():
            core = getattr(getattr(m, "self_attention", None), "core_attention", None)
            number = getattr(m, "layer_number", None)
            if core is None or number is None:
                continue
            i = number - 1
            is_hla = isinstance(core, HLACoreAttention)
            found[i] = core.operator if is_hla else type(core).__name__
            want = pattern[i] if 0 <= i < len(pattern) else None
            if want is None:
                problems.append(f"layer {i} is outside the pattern of {len(pattern)}")
            elif bool(want) != is_hla:
                problems.append(f"layer {i} runs {found[i]}, the pattern says "
                                f"{'HLA' if want else 'softmax'}")
            elif is_hla and operator is not None and core.operator != operator:
                problems.append(f"layer {i} runs {core.operator}, {operator!r} expected")
    if not found:
        problems.append("no transformer layer with a self_attention.core_attention was found")
    if problems:
        raise RuntimeError("the model does not follow --hla-layer-pattern "
                           f"{pattern}: " + "; ".join(problems[:4]))
    return found


def check_trainer_hybrid(hla: dict[str, Any], *, num_layers: int, context_parallel_size: int,
                         cuda: bool) -> list[int] | None:
    """``hla-sp train``'s checks of ``--hla-layer-pattern``; returns the pattern or None.

    The trainer builds the local (non-TE) spec, so its softmax layers are megatron-core's
    DotProductAttention: CUDA only, and without context parallelism.

    Raises:
        ValueError: the pattern with --attention softmax, a bad pattern, softmax layers at
            CP > 1, or softmax layers without CUDA.
    """
    freq = hla.get("hla_layer_pattern")
    if freq is None:
        return None
    if hla.get("attention", "softmax") == "softmax":
        raise ValueError("--hla-layer-pattern needs --attention hla2|ahla|hla3")
    pattern = layer_pattern(freq, num_layers)
    if all(pattern):
        return pattern
    check_hybrid_parallel(pattern, context_parallel_size=context_parallel_size, use_te=False)
    if not cuda:
        raise ValueError(
            f"--hla-layer-pattern {freq}: the {pattern.count(0)} softmax layer(s) run "
            "megatron-core's DotProductAttention, which needs CUDA; on CPU make every layer "
            "HLA (drop --hla-layer-pattern)")
    return pattern

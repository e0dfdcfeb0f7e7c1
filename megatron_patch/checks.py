"""Check that a built model really runs HLA attention (Megatron can swap it silently)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn


def _modules(model: Any) -> Iterable[tuple[str, nn.Module]]:
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, nn.Module):
            raise TypeError(f"model: expected an nn.Module or a list of them, got "
                            f"{type(chunk).__name__} at index {i}")
        prefix = f"[{i}]." if len(chunks) > 1 else ""
        for name, m in chunk.named_modules():
            yield prefix + name, m


def hla_report(model: Any) -> tuple[dict[str, str], dict[str, str]]:
    """(HLA core attentions: name -> operator, other core attentions: name -> class).

    A core attention is whatever sits in an attention module's ``core_attention``
    attribute (megatron-core's SelfAttention slot).
    """
    from hla_sp.megatron_patch.core_attention import HLACoreAttention

    hla: dict[str, str] = {}
    other: dict[str, str] = {}
    for name, m in _modules(model):
        core = getattr(m, "core_attention", None)
        if not isinstance(core, nn.Module):
            continue
        where = f"{name}.core_attention" if name else "core_attention"
        if isinstance(core, HLACoreAttention):
            hla[where] = core.operator
        else:
            other[where] = type(core).__name__
    return hla, other


def assert_hla_model(model: Any, operator: str | None = None) -> dict[str, str]:
    """Raise RuntimeError unless every core attention of ``model`` is HLA.

    Args:
        model: a module, a wrapped module (DDP, Float16Module) or a list of model chunks.
        operator: also require this operator ("hla2", "ahla", "hla3") everywhere.

    Returns:
        name -> operator of every HLA core attention found.
    """
    hla, other = hla_report(model)
    problems = []
    if other:
        problems.append(f"non-HLA core attention in {len(other)} layer(s): "
                        + ", ".join(f"{k} ({v})" for k, v in sorted(other.items())[:4]))
    if not hla and not other:
        problems.append("no attention module with a core_attention slot was found")
    if operator is not None:
        wrong = {k: v for k, v in hla.items() if v != operator}
        if wrong:
            problems.append(f"operator {operator!r} expected, found "
                            + ", ".join(f"{k} ({v})" for k, v in sorted(wrong.items())[:4]))
    if problems:
        raise RuntimeError(
            "the model does not run HLA attention as asked: " + "; ".join(problems)
            + ". Causes seen in Megatron: --spec hid an ImportError and fell back to the "
            "default spec; --attention-backend local replaced the core attention."
        )
    return hla

"""HLA for Megatron-LM / megatron-core (``import hla_sp.megatron_patch``).

* :class:`HLACoreAttention`: megatron-core's ``core_attention`` slot;
* :func:`get_hla_layer_local_spec`, :func:`get_hla_layer_te_spec`,
  :func:`get_hla_layer_spec`: layer specs; ``hla_sp.megatron_patch.specs`` holds
  module-level ones for ``--spec``;
* :func:`add_hla_args`: the ``--attention {softmax,hla2,ahla,hla3}`` and ``--hla-*`` flags;
* :func:`assert_hla_model`: fail loudly when a built model does not run HLA;
* ``python -m hla_sp.megatron_patch.pretrain_gpt``: Megatron's training loop with HLA.

The flags import without megatron-core; everything else is imported on first use, so
that an ImportError surfaces where it is raised (never inside Megatron's ``--spec``,
which would swallow it).
"""

from __future__ import annotations

from typing import Any

from hla_sp.megatron_patch.args import (
    add_hla_args,
    attention_choices,
    check_hla_args,
    check_hla_options,
    custom_imports,
    hla_enabled,
    hla_spec_kwargs,
    import_custom,
)

_LAZY = {
    "HLACoreAttention": "hla_sp.megatron_patch.core_attention",
    "get_hla_layer_local_spec": "hla_sp.megatron_patch.specs",
    "get_hla_layer_te_spec": "hla_sp.megatron_patch.specs",
    "get_hla_layer_spec": "hla_sp.megatron_patch.specs",
    "hla_core_attention_spec": "hla_sp.megatron_patch.specs",
    "assert_hla_model": "hla_sp.megatron_patch.checks",
    "hla_report": "hla_sp.megatron_patch.checks",
}

__all__ = [
    "HLACoreAttention",
    "add_hla_args",
    "assert_hla_model",
    "attention_choices",
    "check_hla_args",
    "check_hla_options",
    "custom_imports",
    "get_hla_layer_local_spec",
    "get_hla_layer_spec",
    "get_hla_layer_te_spec",
    "hla_core_attention_spec",
    "hla_enabled",
    "hla_report",
    "hla_spec_kwargs",
    "import_custom",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hla_sp.megatron_patch' has no attribute {name!r}")

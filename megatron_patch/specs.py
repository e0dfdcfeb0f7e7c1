"""Transformer-layer specs with HLA in the core-attention slot.

* :func:`get_hla_layer_local_spec`: megatron-core's ``get_gpt_layer_local_spec`` with
  the core attention replaced by :class:`HLACoreAttention`;
* :func:`get_hla_layer_te_spec`: the same over the Transformer Engine spec;
* :func:`get_hla_layer_spec`: TE when ``transformer_engine`` imports, else local;
* module-level specs for Megatron's ``--spec MODULE NAME``, one ``<operator>_layer_spec``
  per higher-order operator of the operator table (:mod:`hla_sp.ops.operators`):
  ``--spec hla_sp.megatron_patch.specs hla2_layer_spec`` (also ``ahla_layer_spec``,
  ``hla3_layer_spec``), with the default HLA options.

Two silent failures of Megatron are guarded here:

* ``--spec`` imports the module inside ``try: ... except ImportError: return None`` and
  then builds the default (softmax) spec. An ImportError raised while this module
  loads is therefore re-raised as a RuntimeError, which that ``except`` lets through.
* Newer GPT builders overwrite ``core_attention`` with DotProductAttention under
  ``--attention-backend local``. The submodules object of an HLA spec refuses that
  assignment, loudly.

HLA options travel in the core-attention ModuleSpec's ``params``; Megatron's
``SelfAttention`` calls that spec (``ModuleSpec.__call__`` -> ``build_module``), which
merges them with its own constructor arguments.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

try:
    from hla_sp.megatron_patch.core_attention import HLACoreAttention
    from megatron.core.models.gpt import gpt_layer_specs as _gpt_specs
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from hla_sp.config import HLAConfig
    from hla_sp.ops.operators import TABLE
except ImportError as e:  # see the module docstring: never let --spec swallow this
    raise RuntimeError(
        f"hla_sp.megatron_patch.specs could not be imported ({type(e).__name__}: {e}). "
        "Megatron's --spec would hide this ImportError and train plain softmax attention; "
        "install megatron-core and hla-sp in this environment."
    ) from e

_DEFAULTS = HLAConfig()
HLA_FIELDS = tuple(f.name for f in dataclasses.fields(HLAConfig) if f.name != "operator")



class HLASelfAttentionSubmodules(SelfAttentionSubmodules):
    """SelfAttentionSubmodules whose core attention can only be HLA once set."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "core_attention" and "core_attention" in self.__dict__ and not is_hla_builder(
            value
        ):
            raise RuntimeError(
                f"HLA layer spec: refusing to replace the HLA core attention with {value!r}. "
                "Megatron's GPT builder does this under --attention-backend local; drop that "
                "flag (use the default 'auto') to train with HLA."
            )
        super().__setattr__(name, value)


def is_hla_builder(builder: Any) -> bool:
    """Whether a core-attention builder (class or ModuleSpec) builds HLACoreAttention."""
    module = builder.module if isinstance(builder, ModuleSpec) else builder
    return isinstance(module, type) and issubclass(module, HLACoreAttention)


def hla_core_attention_spec(operator: str | HLAConfig = _DEFAULTS.operator,
                            **options: Any) -> ModuleSpec:
    """The ModuleSpec of HLACoreAttention, whose ``params`` are ``{"hla": HLAConfig}``.

    ``operator`` is an operator's name with ``options`` the other
    :class:`hla_sp.config.HLAConfig` fields (decay, first_order, short_conv, sp_method,
    ...), checked here by the config; or a whole HLAConfig (the trainer's), which passes
    as it is, without options."""
    if isinstance(operator, HLAConfig):
        if options:
            raise TypeError(f"options: expected none with an HLAConfig (it holds them all), "
                            f"got {sorted(options)}")
        return ModuleSpec(module=HLACoreAttention, params={"hla": operator})
    unknown = sorted(set(options) - set(HLA_FIELDS))
    if unknown:
        raise TypeError(f"options: expected HLAConfig fields {HLA_FIELDS}, got {unknown}")
    cfg = HLAConfig(operator=operator, **options)  # type: ignore[arg-type]
    return ModuleSpec(module=HLACoreAttention, params={"hla": cfg})


def _split_options(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(HLA options, megatron-core's keyword arguments) of a spec builder's kwargs."""
    hla = {k: v for k, v in kwargs.items() if k in HLA_FIELDS}
    return hla, {k: v for k, v in kwargs.items() if k not in HLA_FIELDS}


def _replace_core_attention(layer_spec: ModuleSpec, core: ModuleSpec) -> ModuleSpec:
    attn = getattr(layer_spec.submodules, "self_attention", None)
    sub = getattr(attn, "submodules", None)
    if not isinstance(sub, SelfAttentionSubmodules):
        raise TypeError(
            "layer spec: expected a TransformerLayer spec whose self_attention has "
            f"SelfAttentionSubmodules (not MLA/MoE-block variants), got {type(sub).__name__}"
        )
    fields = {f.name: getattr(sub, f.name) for f in dataclasses.fields(sub)}
    fields["core_attention"] = core
    attn.submodules = HLASelfAttentionSubmodules(**fields)
    return layer_spec


def get_hla_layer_local_spec(operator: str | HLAConfig = _DEFAULTS.operator,
                             **kwargs: Any) -> ModuleSpec:
    """``get_gpt_layer_local_spec`` with HLA as core attention.

    ``kwargs`` that are :class:`hla_sp.config.HLAConfig` fields become the core
    attention's config (or ``operator`` is a whole HLAConfig); the rest go to
    megatron-core's function unchanged (e.g. ``normalization="RMSNorm"``).
    """
    hla, megatron_kwargs = _split_options(kwargs)
    core = hla_core_attention_spec(operator, **hla)
    return _replace_core_attention(_gpt_specs.get_gpt_layer_local_spec(**megatron_kwargs), core)


def te_available() -> bool:
    """Whether Transformer Engine imports (it needs CUDA)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # a broken TE install counts as absent, as in megatron-core
        return False
    return True


def get_hla_layer_te_spec(operator: str | HLAConfig = _DEFAULTS.operator,
                          **kwargs: Any) -> ModuleSpec:
    """``get_gpt_layer_with_transformer_engine_spec`` with HLA as core attention (kwargs
    split as in :func:`get_hla_layer_local_spec`).

    TE's fused layernorm + QKV linear and MLP stay; only the attention core changes.
    """
    if not te_available():
        raise RuntimeError("get_hla_layer_te_spec: transformer_engine does not import here; "
                           "use get_hla_layer_local_spec")
    hla, megatron_kwargs = _split_options(kwargs)
    core = hla_core_attention_spec(operator, **hla)
    te = _gpt_specs.get_gpt_layer_with_transformer_engine_spec(**megatron_kwargs)
    return _replace_core_attention(te, core)


def get_hla_layer_spec(operator: str | HLAConfig = _DEFAULTS.operator, *,
                       use_te: bool | None = None,
                       **kwargs: Any) -> ModuleSpec:
    """The TE variant when ``transformer_engine`` imports (or ``use_te``), else local."""
    if use_te is None:
        use_te = te_available()
    fn = get_hla_layer_te_spec if use_te else get_hla_layer_local_spec
    return fn(operator, **kwargs)


# Module-level specs for `--spec hla_sp.megatron_patch.specs hla2_layer_spec`. Megatron's
# own script imports this module after parsing its flags: refuse the ones HLA would not
# honour (--mtp-num-layers, ...) there and then, since nothing of ours runs later.
from hla_sp.megatron_patch.guards import refuse_bypasses_at_spec_import  # noqa: E402

refuse_bypasses_at_spec_import(__name__)
LAYER_SPECS = tuple(f"{name}_layer_spec" for name, op in TABLE.items() if op.higher_order)
for _name in LAYER_SPECS:  # hla2_layer_spec, ahla_layer_spec, hla3_layer_spec
    globals()[_name] = get_hla_layer_spec(_name.removesuffix("_layer_spec"))


def __getattr__(name: str) -> ModuleSpec:
    """``<operator>_layer_spec`` of a higher-order operator registered after import."""
    op = TABLE.get(name.removesuffix("_layer_spec")) if name.endswith("_layer_spec") else None
    if op is None or not op.higher_order:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return get_hla_layer_spec(op.name)

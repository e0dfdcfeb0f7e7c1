"""The Megatron entry point across versions, its refusals, and hybrid HLA/softmax stacks.

Runs on megatron-core 0.16.1 (no megatron.training): everything checked here happens
before Megatron's training loop starts. The loop itself, on 0.17-0.19, is
tests/integration/test_megatron_pretrain.py.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from hla_sp.megatron_patch import compat, hybrid
from hla_sp.megatron_patch.guards import BypassError, refuse_bypasses
from hla_sp.megatron_patch.pretrain_gpt import EXIT_BAD_FLAGS, main

# ------------------------------------------------------------ the three pretrain APIs
# Their signatures as megatron-core 0.17.1, 0.18.0 and 0.19.2 ship them.


def pretrain_017(train_valid_test_dataset_provider, model_provider, model_type,
                 forward_step_func, process_non_loss_data_func=None, extra_args_provider=None,
                 args_defaults=None, get_embedding_ranks=None, get_position_embedding_ranks=None,
                 non_loss_data_func=None, store=None, inprocess_call_wrapper=None):
    """0.17.1"""


def pretrain_018(cfg_container, train_valid_test_dataset_provider, model_provider, model_type,
                 forward_step_func, process_non_loss_data_func=None, get_embedding_ranks=None,
                 get_position_embedding_ranks=None, non_loss_data_func=None, store=None,
                 inprocess_call_wrapper=None):
    """0.18.0"""


def pretrain_019(cfg_container, train_valid_test_dataset_provider, model_type,
                 forward_step_func, model_provider=None, process_non_loss_data_func=None,
                 get_embedding_ranks=None, get_position_embedding_ranks=None,
                 non_loss_data_func=None, store=None, inprocess_call_wrapper=None,
                 p2p_communicator=None, pg_collection=None, skip_model_parallel_init=False):
    """0.19.2"""


class _ArgUtils018:
    pretrain_cfg_container_from_args = None


class _ArgUtils019(_ArgUtils018):
    gpt_config_from_args = None


def test_prebuilt_dataset_helpers_skip_the_compile_only_when_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A wheel ships helpers_cpp built and no Makefile: Megatron's start-up make would exit.
    from megatron.core.datasets import utils

    monkeypatch.setattr(utils, "compile_helpers", utils.compile_helpers)
    assert compat.prebuilt_dataset_helpers() is True
    assert utils.compile_helpers() is None  # no make, no exit
    monkeypatch.setitem(sys.modules, "megatron.core.datasets.helpers_cpp", None)
    real = utils.compile_helpers = object()
    assert compat.prebuilt_dataset_helpers() is False
    assert utils.compile_helpers is real  # a source checkout still compiles


def test_pretrain_api_is_routed_by_what_the_version_offers():
    """0.18 takes a config container *and* a model_provider, and has no
    gpt_config_from_args: before, its signature sent it down the 0.19 path."""
    assert compat.pretrain_api(pretrain_017) == "legacy"
    assert compat.pretrain_api(pretrain_018, _ArgUtils018) == "provider"
    assert compat.pretrain_api(pretrain_019, _ArgUtils019) == "config"
    # an optional model_provider without a GPT model config: the provider route
    assert compat.pretrain_api(pretrain_019, _ArgUtils018) == "provider"
    with pytest.raises(RuntimeError, match="does not know"):
        compat.pretrain_api(lambda a, b: None)


def test_cp_split_passes_is_hybrid_cp_and_the_group():
    """From 0.18 is_hybrid_cp is required and cp_group=None means WORLD."""
    seen: dict[str, Any] = {}

    def split_018(batch, is_hybrid_cp, cp_group=None, hybrid_cp_group_func=None):
        seen.update(is_hybrid_cp=is_hybrid_cp, cp_group=cp_group)
        return batch

    def split_016(batch, cp_group=None):
        seen.update(old=cp_group)
        return batch

    group = object()
    assert compat.cp_split({"tokens": 1}, group, split_018) == {"tokens": 1}
    assert seen["is_hybrid_cp"] is False and seen["cp_group"] is group
    compat.cp_split({}, group, split_016)
    assert seen["old"] is group
    with pytest.raises(ValueError, match="WORLD"):
        compat.cp_split({}, None, split_018)


def _split_task(rank: int, world_size: int) -> list[int]:
    """Megatron's own function through cp_split, over parallel_state's CP group."""
    from megatron.core import parallel_state as ps

    warnings.simplefilter("ignore")
    ps.initialize_model_parallel(context_parallel_size=world_size)
    try:
        batch = {"tokens": torch.arange(8)[None]}
        return compat.cp_split(batch, ps.get_context_parallel_group())["tokens"][0].tolist()
    finally:
        ps.destroy_model_parallel()


def test_cp_split_with_megatrons_function(world):
    assert world(2).run(_split_task) == [[0, 1, 6, 7], [2, 3, 4, 5]]  # zigzag


# ------------------------------------------------------------------ refusals


BYPASSES = [
    (["--mtp-num-layers", "1"], "--mtp-num-layers 1", "multi-token-prediction"),
    (["--use-legacy-models"], "--use-legacy-models", "legacy GPT model"),
    (["--multi-latent-attention"], "--multi-latent-attention", "no MLA variant"),
    (["--experimental-attention-variant", "gated_delta_net"],
     "--experimental-attention-variant gated_delta_net", "own attention variant"),
    (["--linear-attention-freq", "4"], "--linear-attention-freq 4", "--hla-layer-pattern"),
    (["--use-kitchen-attention"], "--use-kitchen-attention", "Kitchen"),
    (["--softmax-type", "learnable"], "--softmax-type learnable", "no softmax"),
]


@pytest.mark.parametrize(("flags", "named", "why"), BYPASSES,
                         ids=[b[0][0].lstrip("-") for b in BYPASSES])
def test_entry_point_refuses_bypass_flags(capsys, flags, named, why):
    assert main(["--attention", "hla2", "--num-layers", "2", *flags]) == EXIT_BAD_FLAGS
    err = capsys.readouterr().err
    assert f"{named} with --attention hla2" in err and why in err, err


@pytest.mark.parametrize("flags", [["--mtp-num-layers", "2"], ["--use-legacy-models"]])
def test_spec_route_refuses_bypass_flags(capsys, flags):
    argv = ["--spec", "hla_sp.megatron_patch.specs", "hla2_layer_spec", *flags]
    assert main(argv) == EXIT_BAD_FLAGS
    assert "with --spec hla_sp.megatron_patch.specs hla2_layer_spec" in capsys.readouterr().err


def test_softmax_keeps_megatrons_flags():
    """The refusals are for HLA only: a softmax run is Megatron's business."""
    ns = argparse.Namespace(mtp_num_layers=1, use_legacy_models=True, softmax_type="learnable")
    with pytest.raises(BypassError):
        refuse_bypasses(ns, "--attention hla2")
    refuse_bypasses(argparse.Namespace(softmax_type="vanilla", mtp_num_layers=0), "x")


# ------------------------------------------------------------------ hybrid stacks


@pytest.mark.parametrize("freq", ["4", "3", "1", "([1]*3+[0]*1)*2", "[0]+[1]*7"])
def test_layer_pattern_reads_like_linear_attention_freq(freq):
    """Same pattern as Megatron's get_linear_attention_pattern (1 = linear/HLA)."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_linear_attention_pattern,
    )

    value = hybrid.parse_layer_pattern(freq)
    cfg = argparse.Namespace(linear_attention_freq=value, num_layers=8,
                             experimental_attention_variant="gated_delta_net")
    theirs = get_linear_attention_pattern(cfg)
    if any(theirs):
        assert hybrid.layer_pattern(freq, 8) == theirs
    else:
        with pytest.raises(ValueError, match="no layer runs HLA"):
            hybrid.layer_pattern(freq, 8)


@pytest.mark.parametrize("text", ["__import__('os')", "0", "[2, 1]", "", "[]", "1e3", "(3)"])
def test_layer_pattern_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        hybrid.parse_layer_pattern(text)


def test_layer_pattern_length_must_match():
    with pytest.raises(ValueError, match="3 entries for --num-layers 4"):
        hybrid.layer_pattern("[1,0,1]", 4)


def test_hybrid_at_cp2_without_te_is_refused(capsys):
    argv = ["--attention", "hla2", "--num-layers", "4", "--hla-layer-pattern", "2",
            "--context-parallel-size", "2", "--transformer-impl", "local"]
    assert main(argv) == EXIT_BAD_FLAGS
    err = capsys.readouterr().err
    assert "need Transformer Engine's context-parallel attention" in err, err
    # every layer HLA: no softmax layer needs TE
    assert hybrid.check_hybrid_parallel([1, 1], context_parallel_size=2, use_te=False) is None
    with pytest.raises(ValueError, match="pipeline"):
        hybrid.check_hybrid_parallel([1, 0], context_parallel_size=1, pipeline_parallel_size=2,
                                     use_te=True)


def _hybrid_models_task(rank: int, world_size: int) -> dict:
    """GPT models with hybrid block specs: which layer runs what; all-HLA equals plain."""
    from hla_sp.megatron_patch import get_hla_layer_local_spec
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    warnings.simplefilter("ignore")
    ps.initialize_model_parallel()
    try:
        cfg = TransformerConfig(
            num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
            use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
            bias_dropout_fusion=False, masked_softmax_fusion=False,
            gradient_accumulation_fusion=False, persist_layer_norm=False)

        def gpt(spec: Any) -> Any:
            torch.manual_seed(0)
            return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=64,
                            max_sequence_length=32, position_embedding_type="learned_absolute")

        hla = get_hla_layer_local_spec("ahla", chunk_size=8)
        out: dict = {}
        pattern = hybrid.layer_pattern("([1]*1+[0]*1)*2", 4)
        model = gpt(hybrid.hybrid_block_spec(pattern, hla, get_gpt_layer_local_spec()))
        out["found"] = hybrid.assert_hybrid_model(model, pattern, "ahla")
        for name, (pat, op) in {"wrong": ([1, 1, 0, 0], "ahla"),
                                "operator": (pattern, "hla2")}.items():
            try:
                hybrid.assert_hybrid_model(model, pat, op)
                out[name] = None
            except RuntimeError as e:
                out[name] = str(e)
        plain = gpt(hla)
        every = gpt(hybrid.hybrid_block_spec([1] * 4, hla, get_gpt_layer_local_spec()))
        tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
        pos = torch.arange(32).expand(2, 32)
        out["same_keys"] = plain.state_dict().keys() == every.state_dict().keys()
        out["all_hla_err"] = (plain(tokens, pos, None) - every(tokens, pos, None)).abs().max()
        return out
    finally:
        ps.destroy_model_parallel()


def test_hybrid_block_spec_builds_the_pattern(world):
    out = world(1).run(_hybrid_models_task)[0]
    assert out["found"] == {0: "ahla", 1: "DotProductAttention", 2: "ahla",
                            3: "DotProductAttention"}
    assert "layer 1 runs DotProductAttention, the pattern says HLA" in out["wrong"]
    assert "'hla2' expected" in out["operator"]
    assert out["same_keys"] and out["all_hla_err"] == 0.0


# ----------------------------------------------------------------- hla-sp train


def test_trainer_hybrid_pattern():
    from hla_sp.launch.checks import validate
    from hla_sp.launch.config.train_config import ConfigError, parse_args
    from hla_sp.launch.model.build import layer_spec

    base = ["--num-layers", "4", "--seq-length", "64", "--hla-layer-pattern"]
    cfg = parse_args([*base, "([1]*3+[0])"])
    assert cfg.model.hla_layer_pattern == [1, 1, 1, 0]
    block = layer_spec(cfg)
    cores = [s.submodules.self_attention.submodules.core_attention for s in block.layer_specs]
    from hla_sp.megatron_patch.specs import is_hla_builder

    assert [is_hla_builder(c) for c in cores] == [True, True, True, False]
    if not torch.cuda.is_available():  # the softmax layers need CUDA in the trainer
        with pytest.raises(ConfigError, match="needs CUDA"):
            validate(cfg, 1)
    with pytest.raises(ConfigError, match="Transformer Engine"):
        validate(parse_args([*base, "2", "--context-parallel-size", "2"]), 2)
    validate(parse_args([*base, "[1]*4"]), 1)  # all HLA: fine on CPU
    with pytest.raises(ConfigError, match="needs --attention"):
        validate(parse_args([*base, "2", "--attention", "softmax"]), 1)
    with pytest.raises(SystemExit):
        parse_args([*base, "os.system"])



def test_megatrons_own_script_spec_route_refuses_mtp(monkeypatch):
    """Megatron-LM's pretrain_gpt.py parses its flags, then its model_provider imports
    ``--spec``: the spec module refuses there (Megatron's importer catches ImportError
    only, so the refusal is not swallowed into a softmax fallback)."""
    import sys
    import types

    from megatron.core.transformer.spec_utils import import_module

    gv = types.ModuleType("megatron.training.global_vars")
    gv._GLOBAL_ARGS = argparse.Namespace(  # type: ignore[attr-defined]
        spec=["hla_sp.megatron_patch.specs", "hla2_layer_spec"], mtp_num_layers=1)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", gv)
    monkeypatch.delitem(sys.modules, "hla_sp.megatron_patch.specs", raising=False)
    with pytest.raises(BypassError, match="--mtp-num-layers 1 with --spec hla_sp"):
        import_module(("hla_sp.megatron_patch.specs", "hla2_layer_spec"))
    gv._GLOBAL_ARGS.mtp_num_layers = None  # type: ignore[attr-defined]
    monkeypatch.delitem(sys.modules, "hla_sp.megatron_patch.specs", raising=False)
    assert import_module(("hla_sp.megatron_patch.specs", "hla2_layer_spec")) is not None

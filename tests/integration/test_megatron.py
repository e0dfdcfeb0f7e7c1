"""hla_sp.megatron_patch on megatron-core (CPU, gloo): the core attention, specs, flags,
the entry point, and the two silent failures of Megatron that must fail loudly."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")

from hla_sp.megatron_patch import (
    add_hla_args,
    assert_hla_model,
    check_hla_args,
    get_hla_layer_local_spec,
    get_hla_layer_spec,
    hla_spec_kwargs,
)

HAVE_TRAINING = importlib.util.find_spec("megatron.training") is not None
VOCAB = 64


# ------------------------------------------------------------------------------ flags


def _megatron_like_parser() -> argparse.ArgumentParser:
    """A parser shaped like Megatron's: allow_abbrev=False and its --attention-* flags."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--attention-backend", default="auto",
                   choices=["auto", "local", "flash", "fused", "unfused"])
    p.add_argument("--attention-dropout", type=float, default=0.1)
    p.add_argument("--attention-softmax-in-fp32", action="store_true")
    p.add_argument("--spec", nargs="*", default=None)
    return p


def test_flags_parse_beside_attention_backend():
    p = add_hla_args(_megatron_like_parser())
    a = p.parse_args([])
    assert a.attention == "softmax" and a.attention_backend == "auto"
    a = p.parse_args(["--attention", "hla2", "--attention-backend", "flash",
                      "--attention-dropout", "0", "--hla-decay", "data", "--hla-normalize",
                      "--hla-chunk-size", "128", "--hla-sp-method", "ring", "--hla-ridge", "0.5"])
    assert (a.attention, a.attention_backend, a.attention_dropout) == ("hla2", "flash", 0.0)
    assert hla_spec_kwargs(a) == dict(operator="hla2", decay="data", first_order=True,
                                      mix_norm=False, short_conv=4, normalize=True, ridge=0.5,
                                      chunk_size=128, precision="auto", sp_method="ring")
    a = p.parse_args(["--attention", "hla3", "--no-hla-first-order"])
    assert hla_spec_kwargs(a)["first_order"] is False
    a = p.parse_args(["--attention-backend", "local", "--attention", "ahla"])
    assert (a.attention, a.attention_backend) == ("ahla", "local")


@pytest.mark.parametrize("argv", [["--attention", "flash"], ["--hla-chunk-size", "48"],
                                  ["--hla-decay", "exp"], ["--hla-ridge", "-1"],
                                  ["--attent", "hla2"]])
def test_flags_reject_bad_values(argv):
    p = add_hla_args(_megatron_like_parser())
    with pytest.raises(SystemExit):
        p.parse_args(argv)


def test_flags_twice_is_an_error():
    p = add_hla_args(_megatron_like_parser())
    with pytest.raises(ValueError, match="already defined"):
        add_hla_args(p)
    with pytest.raises(TypeError, match="parser"):
        add_hla_args(object())  # type: ignore[arg-type]


def test_flags_are_generated_from_hla_config():
    from hla_sp.config import DECAYS, SP_METHODS, HLAConfig

    p = add_hla_args(_megatron_like_parser())
    defaults = p.parse_args([])
    for f in HLAConfig.flag_fields():
        assert getattr(defaults, f"hla_{f.name}") == f.default, f.name
    actions = {a.dest: a for a in p._actions}
    assert tuple(actions["hla_decay"].choices) == DECAYS
    assert tuple(actions["hla_sp_method"].choices) == SP_METHODS
    with pytest.raises(SystemExit):
        p.parse_args(["--hla-chunk-size", "48"])  # not a power of two


def test_check_hla_args_refuses_silent_failures():
    p = add_hla_args(_megatron_like_parser())
    check_hla_args(p.parse_args(["--attention-backend", "local"]))  # softmax: Megatron's own
    with pytest.raises(ValueError, match="attention-backend local"):
        check_hla_args(p.parse_args(["--attention", "hla2", "--attention-backend", "local"]))
    with pytest.raises(ValueError, match="--spec"):
        check_hla_args(p.parse_args(["--attention", "hla3", "--spec", "m", "n"]))
    with pytest.raises(ValueError, match="hla2 only"):
        check_hla_args(p.parse_args(["--attention", "ahla", "--hla-normalize"]))


@pytest.mark.skipif(not HAVE_TRAINING, reason="megatron.training is not installed "
                    "(megatron-core >= 0.17 needs Python >= 3.12; 0.16.1 has no megatron.training)")
def test_flags_with_megatrons_real_parser(monkeypatch):
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["x", "--attention", "hla2", "--attention-backend", "flash",
                                      "--hla-chunk-size", "128"])
    a = parse_args(extra_args_provider=add_hla_args)
    assert a.attention == "hla2" and a.hla_chunk_size == 128
    assert str(getattr(a.attention_backend, "name", a.attention_backend)) == "flash"
    monkeypatch.setattr(sys, "argv", ["x"])
    assert parse_args(extra_args_provider=add_hla_args).attention == "softmax"


# ------------------------------------------------------------------------ entry point


def _entry(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "hla_sp.megatron_patch.pretrain_gpt", *argv],
                          capture_output=True, text=True, timeout=180, env=env)


@pytest.mark.skipif(HAVE_TRAINING, reason="megatron.training imports here")
def test_entry_point_without_megatron_training_says_so():
    r = _entry("--attention", "hla2", "--num-layers", "2")
    assert r.returncode == 3, r.stderr
    assert "megatron.training is not importable" in r.stderr
    assert "megatron-core >= 0.17" in r.stderr and "Python >= 3.12" in r.stderr


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--attention", "hla2", "--attention-backend", "local"], "attention-backend local"),
        (["--attention", "hla2", "--spec", "hla_sp.megatron_patch.specs", "hla2_layer_spec"],
         "builds the HLA layer spec itself"),
        (["--spec", "no_such_module_for_hla", "spec"], "does not import"),
        (["--spec", "hla_sp.megatron_patch.specs", "no_such_spec"], "no attribute"),
    ],
    ids=["backend-local", "spec-with-hla", "spec-import-error", "spec-missing-name"],
)
def test_entry_point_fails_loudly(argv, match):
    r = _entry(*argv, "--num-layers", "2")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert match in r.stderr


# ------------------------------------------------------------------- the spec route


def test_spec_route_through_megatrons_importer():
    from hla_sp.megatron_patch.specs import is_hla_builder
    from megatron.core.transformer.spec_utils import import_module

    from hla_sp.config import HLA_OPERATORS

    for op in HLA_OPERATORS:  # every higher-order operator of the table has its spec
        spec = import_module(("hla_sp.megatron_patch.specs", f"{op}_layer_spec"))
        core = spec.submodules.self_attention.submodules.core_attention
        assert is_hla_builder(core) and core.params["hla"].operator == op


def test_spec_import_error_is_not_swallowed(monkeypatch):
    """Megatron's import_module returns None on ImportError (then trains softmax); an
    ImportError while our spec module loads must come out as a RuntimeError instead."""
    from megatron.core.transformer.spec_utils import import_module

    monkeypatch.delitem(sys.modules, "hla_sp.megatron_patch.specs", raising=False)
    monkeypatch.setitem(sys.modules, "hla_sp.config", None)  # "not installed"
    with pytest.raises(RuntimeError, match="would hide this ImportError"):
        import_module(("hla_sp.megatron_patch.specs", "hla2_layer_spec"))


def test_backend_local_overwrite_is_refused():
    """Newer GPT builders assign DotProductAttention to the slot under
    --attention-backend local; an HLA spec refuses the assignment."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    spec = get_hla_layer_local_spec("hla2")
    sub = spec.submodules.self_attention.submodules
    with pytest.raises(RuntimeError, match="attention-backend local"):
        sub.core_attention = DotProductAttention
    # Swapping one HLA option set for another is allowed.
    sub.core_attention = get_hla_layer_local_spec("ahla").submodules.self_attention.submodules \
        .core_attention


def test_specs_te_and_fallback():
    from hla_sp.megatron_patch.specs import get_hla_layer_te_spec, te_available

    spec = get_hla_layer_spec("hla3", use_te=False, decay="fixed", normalization="RMSNorm")
    params = spec.submodules.self_attention.submodules.core_attention.params
    assert params["hla"].operator == "hla3" and params["hla"].decay == "fixed"
    if te_available():
        te = get_hla_layer_te_spec("hla2")
        core = te.submodules.self_attention.submodules.core_attention
        assert core.params["hla"].operator == "hla2"
    else:
        with pytest.raises(RuntimeError, match="transformer_engine"):
            get_hla_layer_te_spec("hla2")
        assert get_hla_layer_spec("hla2").submodules.self_attention.submodules.core_attention \
            .params["hla"].operator == "hla2"
    with pytest.raises(ValueError, match="operator"):
        get_hla_layer_local_spec("softmax")
    with pytest.raises(ValueError, match="sp_method"):
        get_hla_layer_local_spec("hla2", sp_method="a2a")
    # a whole HLAConfig passes as it is, the same object down to the core attention
    from hla_sp.config import HLAConfig

    hla = HLAConfig(operator="ahla", decay="data")
    core = get_hla_layer_local_spec(hla).submodules.self_attention.submodules.core_attention
    assert core.params["hla"] is hla
    with pytest.raises(TypeError, match="expected none with an HLAConfig"):
        get_hla_layer_local_spec(hla, decay="fixed")


# ------------------------------------------------------------- models (in a gloo world)


def _setup() -> None:
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             context_parallel_size=1)


def _config(groups: int = 2):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=groups,
        ffn_hidden_size=64, use_cpu_initialization=True, attention_dropout=0.0,
        hidden_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
    )


def _gpt(spec, seq: int):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(0)
    return GPTModel(config=_config(), transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=seq, position_embedding_type="learned_absolute")


def checks_task(rank: int, world_size: int) -> dict:
    """assert_hla_model on HLA and softmax models; the core attention by itself."""
    from hla_sp.megatron_patch import HLACoreAttention
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    _setup()
    out: dict = {}
    try:
        model = _gpt(get_hla_layer_local_spec("hla2", decay="data"), 32)
        out["found"] = assert_hla_model([model], "hla2")
        for bad, kw in (("softmax", {}), ("operator", {"operator": "ahla"})):
            m = _gpt(get_gpt_layer_local_spec(), 32) if bad == "softmax" else model
            try:
                assert_hla_model(m, **kw)
                out[bad] = None
            except RuntimeError as e:
                out[bad] = str(e)
        # The core attention is HLAHeads on [b, s, h, d]: same numbers, Megatron layout.
        core = HLACoreAttention(config=_config(), layer_number=1,
                                attn_mask_type=AttnMaskType.causal, attention_type="self",
                                decay="learned", chunk_size=8)
        g = torch.Generator().manual_seed(3)
        q = torch.randn(20, 2, 4, 8, generator=g)
        k = torch.randn(20, 2, 2, 8, generator=g)
        v = torch.randn(20, 2, 2, 8, generator=g)
        o = core(q, k, v, None)
        ref, _ = core.heads(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        out["sbhd_err"] = (o - ref.transpose(0, 1).reshape(20, 2, 32)).abs().max().item()
        out["sbhd_shape"] = tuple(o.shape)
        cu = torch.tensor([0, 7, 20], dtype=torch.int32)
        ps = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=13, max_seqlen_kv=13)
        o3 = core(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=ps)
        doc2, _ = core.heads(q[None, 7:, 0], k[None, 7:, 0], v[None, 7:, 0])
        out["thd_shape"] = tuple(o3.shape)
        # The same in fp64: packed equals alone to fp64 rounding, and in fp32 the packed
        # run errs against it at most twice what the alone run does (flash-attention's
        # rule; the chunk boundaries move with the document start).
        core64 = HLACoreAttention(config=_config(), layer_number=1,
                                  attn_mask_type=AttnMaskType.causal, attention_type="self",
                                  decay="learned", chunk_size=8)
        core64.load_state_dict(core.state_dict())
        core64.double()
        q64, k64, v64 = (t.double() for t in (q, k, v))
        packed64 = core64(q64[:, 0], k64[:, 0], v64[:, 0], None, packed_seq_params=ps)[7:]
        alone64 = core64.heads(q64[None, 7:, 0], k64[None, 7:, 0], v64[None, 7:, 0])[0]
        alone64 = alone64[0].reshape(13, 32)
        out["thd_fp64_rel"] = ((packed64 - alone64).abs().max() / alone64.abs().max()).item()
        out["thd_err"] = (o3[7:] - alone64).abs().max().item()
        out["thd_alone_err"] = (doc2[0].reshape(13, 32) - alone64).abs().max().item()
        errors = {}
        for name, call in (
            ("bias", lambda: core(q, k, v, None, attention_bias=torch.zeros(1))),
            ("mask", lambda: core(q, k, v, None, attn_mask_type=AttnMaskType.no_mask)),
            ("thd3d", lambda: core(q[:, 0], k[:, 0], v[:, 0], None)),
        ):
            try:
                call()
                errors[name] = None
            except ValueError as e:
                errors[name] = str(e)
        out["errors"] = errors
        return out
    finally:
        parallel_state.destroy_model_parallel()


def test_assert_hla_model_and_core_attention(world):
    out = world(1).run(checks_task)[0]
    assert len(out["found"]) == 2 and set(out["found"].values()) == {"hla2"}
    assert out["softmax"] and "DotProductAttention" in out["softmax"]
    assert out["operator"] and "'ahla' expected" in out["operator"]
    assert out["sbhd_shape"] == (20, 2, 32) and out["sbhd_err"] == 0.0
    assert out["thd_shape"] == (20, 32) and out["thd_fp64_rel"] < 1e-10, out
    assert out["thd_err"] <= 2 * out["thd_alone_err"], out
    assert "attention_bias" in out["errors"]["bias"]
    assert "attn_mask_type" in out["errors"]["mask"]
    assert "thd" in out["errors"]["thd3d"]


def train_task(rank: int, world_size: int, steps: int, seq: int) -> list[float]:
    """Adam steps of a tiny GPT with the HLA spec (default options) on a fixed batch."""
    from megatron.core import parallel_state

    _setup()
    try:
        model = _gpt(get_hla_layer_local_spec("hla2"), seq)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(5)
        base = torch.randint(0, VOCAB, (4, 16), generator=g)
        data = base.repeat(1, seq // 16 + 1)[:, : seq + 1]  # period 16: learnable in context
        pos = torch.arange(seq).expand(4, seq)
        losses = []
        for _ in range(steps):
            per_token = model(data[:, :-1], pos, None, labels=data[:, 1:])
            loss = per_token.float().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses
    finally:
        parallel_state.destroy_model_parallel()


def test_ten_optimizer_steps_lower_the_loss(world):
    losses = world(1).run(train_task, 10, 128)[0]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0] - 0.5, losses


def packed_task(rank: int, world_size: int, threads: int = 1) -> dict[str, float]:
    """A THD batch of three documents equals each document run alone (GQA model): in
    fp64 to fp64 rounding; in fp32 the packed logits err against fp64 at most twice
    what the documents run alone do (flash-attention's rule)."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    _setup()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = _gpt(get_hla_layer_local_spec("hla2", decay="fixed", chunk_size=8), 48)
        tokens = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(1))
        cu = torch.tensor([0, 13, 31, 48], dtype=torch.int32)
        bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
        pos = torch.cat([torch.arange(e - s) for s, e in bounds])[None]
        ps = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=18, max_seqlen_kv=18)
        model64 = _gpt(get_hla_layer_local_spec("hla2", decay="fixed", chunk_size=8), 48)
        model64.load_state_dict(model.state_dict())
        model64.double()
        packed = model(tokens, pos, None, packed_seq_params=ps)
        packed64 = model64(tokens, pos, None, packed_seq_params=ps)
        out = {"fp64_rel": 0.0, "packed_err": 0.0, "alone_err": 0.0}
        for s, e in bounds:
            alone = model(tokens[:, s:e], torch.arange(e - s)[None], None)
            alone64 = model64(tokens[:, s:e], torch.arange(e - s)[None], None)
            scale = alone64.abs().max().item()
            out["fp64_rel"] = max(out["fp64_rel"],
                                  (packed64[:, s:e] - alone64).abs().max().item() / scale)
            out["packed_err"] = max(out["packed_err"],
                                    (packed[:, s:e] - alone64).abs().max().item())
            out["alone_err"] = max(out["alone_err"], (alone - alone64).abs().max().item())
        return out
    finally:
        torch.set_num_threads(before)
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("threads", [1, 2])
def test_packed_documents_are_independent(world, threads):
    out = world(1).run(packed_task, threads)[0]
    assert out["fp64_rel"] < 1e-10, out
    assert out["packed_err"] <= 2 * out["alone_err"], out

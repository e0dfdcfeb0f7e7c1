"""``hla_sp.hf``: the Hugging Face model computes what the trainer's GPTModel computes.

Tiny models, no download. The trainer's model is megatron-core's GPTModel from
``build_model`` (padded vocabulary, HLA in every layer); the HF model gets its weights
through ``hf_state_dict``. Equalities are in fp32 to 1e-5 of the largest logit: the two
run the same operations on the same weights, only Megatron's [s, b] layout against the
HF model's [b, s] may block the matrix products differently (measured: 0 difference).
Decoding through the cache against one forward is checked in fp64 to 1e-10, as in
tests/integration/test_generate.py (the operator sums in chunks of 64 against one step per token).
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from unittest import mock

import pytest
import torch

pytest.importorskip("megatron.core")  # the reference is the trainer's GPTModel

from hla_sp.launch.config.train_config import parse_args
from hla_sp.launch.export import generate as gen
from hla_sp.launch.export.hf_convert import ConvertError, hf_config_from_train, hf_state_dict
from hla_sp.launch.model.build import build_model, model_dtype
from transformers import AutoConfig, AutoModelForCausalLM

import hla_sp.hf
from hla_sp.hf import HLASPCache, HLASPConfig, HLASPForCausalLM

VOCAB, EOD = gen.BYTE_VOCAB, gen.EOD
RTOL = 1e-5  # fp32, relative to the largest logit (see the module docstring)
TOL64 = 1e-10  # fp64, relative to the largest logit


def _cfg(position: str = "learned_absolute", groups: int = 2, *flags: str):
    return parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                       "--num-query-groups", str(groups), "--seq-length", "48",
                       "--position-embedding-type", position, "--attention", "hla2",
                       "--hla-decay", "data", *flags])


@pytest.fixture(scope="module")
def single():
    warnings.simplefilter("ignore")
    # megatron-core moves rope's inverse frequencies to the current CUDA device on first
    # use (its only CUDA call; the math is device-independent): on a CPU-only machine
    # "the current device" is the CPU, so the reference rope runs here too
    with gen.single_process(), mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
        yield


def _gpt(cfg):
    """The trainer's model, with the first-order mixes, norm gains and data-decay
    weights made non-trivial (they start at 0/1, where they would hide a mistake)."""
    torch.manual_seed(0)
    model = build_model(gen.decode_config(cfg), VOCAB).to(dtype=model_dtype(cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("key_mix", "value_mix", "norm_weight", "decay_weight")):
                p.copy_(torch.rand_like(p) + 0.5)
    return model


def _hf(gpt, cfg) -> HLASPForCausalLM:
    config = hf_config_from_train(cfg, VOCAB, EOD)
    model = HLASPForCausalLM(config).to(config.dtype).eval()
    missing, unexpected = model.load_state_dict(hf_state_dict(gpt, config), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # lm_head is the embedding
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


POSITIONS = [("learned_absolute", 2, ()), ("rope", 2, ()), ("none", 2, ()),
             ("learned_absolute", 4, ()), ("rope", 2, ("--bf16",))]


@pytest.mark.parametrize("position,groups,flags", POSITIONS,
                         ids=[f"{p}-kv{g}{''.join(f)}" for p, g, f in POSITIONS])
def test_logits_equal_the_trainers_model(single, position, groups, flags):
    cfg = _cfg(position, groups, *flags)
    gpt = _gpt(cfg)
    hf = _hf(gpt, cfg)
    x = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = gpt(x, torch.arange(40)[None].expand(2, -1), None)
        got = hf(x).logits
    assert want.shape[-1] == 384 and got.shape[-1] == VOCAB  # padded rows dropped
    assert bool((want[..., VOCAB:] == float("-inf")).all())  # they take no probability
    want = want[..., :VOCAB]
    assert got.dtype == want.dtype == model_dtype(cfg)
    scale = float(want.abs().max())
    # bf16: one rounding of a logit, 2^-8 of it, should the two ever round apart
    # (measured: they do not)
    tol = 2.0**-8 if cfg.precision.bf16 else RTOL
    assert float((got.float() - want.float()).abs().max()) <= tol * scale
    if position == "rope":  # the rotation does something: the same weights without it differ
        hf.config.position_embedding_type = "none"
        try:
            with torch.no_grad():
                assert float((hf(x).logits - got).abs().max()) > 1e-3 * scale
        finally:
            hf.config.position_embedding_type = "rope"
    if groups == 4:  # the loss too: Megatron's per-token loss on the shifted labels
        with torch.no_grad():
            per_token = gpt(x[:, :-1], torch.arange(39)[None].expand(2, -1), None,
                            labels=x[:, 1:])
            loss = hf(x, labels=x).loss
        assert abs(float(loss) - float(per_token.mean())) <= 1e-6 * float(loss)


@pytest.mark.parametrize("position", ["learned_absolute", "rope", "none"])
def test_prefill_and_decode_equal_one_forward(single, position):
    cfg = _cfg(position)
    hf = _hf(_gpt(cfg), cfg).double()
    T, first = 30, 11
    x = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = hf(x, use_cache=False)
        assert full.past_key_values is None
        out = hf(x[:, :first], use_cache=True)
        cache = out.past_key_values
        parts = [out.logits]
        for t in range(first, T):
            out = hf(x[:, t : t + 1], past_key_values=cache, use_cache=True)
            assert out.past_key_values is cache
            parts.append(out.logits)
    assert isinstance(cache, HLASPCache) and cache.get_seq_length() == T
    scale = float(full.logits.abs().max())
    assert float((torch.cat(parts, 1) - full.logits).abs().max()) <= TOL64 * scale


def test_greedy_generate_equals_hla_sp_generate(single, tmp_path):
    """Through a saved checkpoint, as ``hla-sp export`` reads one: generate.load_model."""
    from hla_sp.launch import checkpoint

    cfg = _cfg()

    class _Sched:
        def state_dict(self) -> dict:
            return {}

    gpt = _gpt(cfg)
    checkpoint.save(str(tmp_path), 1, rank=0, world_size=1, tp_rank=0, writes_model=True,
                    model=gpt, optimizer=torch.optim.SGD(gpt.parameters(), lr=0.1),
                    scheduler=_Sched(), consumed_samples=0, config=cfg.to_dict())
    loaded, saved_cfg = gen.load_model(str(tmp_path))
    hf = _hf(loaded, saved_cfg)
    prompt = list(b"the cat")
    want = gen.generate(loaded, prompt, max_new_tokens=12, temperature=0.0,
                        stop_at_eod=False).tokens
    hf.generation_config.eos_token_id = None  # as stop_at_eod=False
    with torch.no_grad():
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert ids[0, len(prompt):].tolist() == want and len(want) == 12


def test_prepare_inputs_feeds_only_new_tokens():
    hf = HLASPForCausalLM(HLASPConfig(vocab_size=50, hidden_size=32)).eval()
    ids = torch.randint(0, 50, (1, 9))
    cache = HLASPCache(2)
    assert hf.prepare_inputs_for_generation(ids, past_key_values=cache)["input_ids"].shape[1] == 9
    cache.seen = 8
    step = hf.prepare_inputs_for_generation(ids, past_key_values=cache)
    assert step["input_ids"].tolist() == ids[:, 8:].tolist() and step["past_key_values"] is cache


@pytest.mark.parametrize("beams", [1, 3], ids=["greedy", "beams"])
def test_generate_with_the_cache_equals_without(beams):
    """A batch of two, greedy and beam search (the cache's rows reordered per step):
    the same tokens as generate() recomputing the whole sequence at every step."""
    torch.manual_seed(0)
    hf = HLASPForCausalLM(HLASPConfig(vocab_size=100, hidden_size=32,
                                      num_key_value_heads=2)).double().eval()
    x = torch.randint(0, 99, (2, 6), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=5, do_sample=False, num_beams=beams, eos_token_id=None,
              attention_mask=torch.ones_like(x))
    with torch.no_grad():
        cached = hf.generate(x, use_cache=True, **kw)
        full = hf.generate(x, use_cache=False, **kw)
    assert cached.shape == (2, 11) and torch.equal(cached, full)


def test_save_pretrained_round_trips(single, tmp_path):
    cfg = _cfg("rope", 2, "--hla-short-conv", "3")
    hf = _hf(_gpt(cfg), cfg)
    hf.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, HLASPConfig) and config.hla_config() == hf.config.hla_config()
    assert config.vocab_size == VOCAB and config.eod_token_id == EOD
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(back, HLASPForCausalLM)
    assert back.lm_head.weight is back.model.embed_tokens.weight
    for (name, a), (_, b) in zip(hf.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    x = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(hf(x).logits, back(x).logits)


def test_refusals(single):
    with pytest.raises(ConvertError, match=r"expected HLA in every layer .* got --attention "
                                           r"softmax"):
        hf_config_from_train(parse_args(["--attention", "softmax"]), VOCAB, EOD)
    cfg = _cfg()
    gpt = _gpt(cfg)
    other = hf_config_from_train(_cfg("none"), VOCAB, EOD)
    with pytest.raises(ConvertError, match=r"model.embed_positions.weight'\] unused"):
        hf_state_dict(gpt, other)
    hf = _hf(gpt, cfg)
    x = torch.randint(0, VOCAB, (1, 6))
    with pytest.raises(ValueError, match="attention_mask: expected all ones"):
        hf(x, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="exceed the model's 48 learned positions"):
        hf(torch.zeros(1, 49, dtype=torch.long))
    with pytest.raises(ValueError, match=r"decay: expected one of \("):
        HLASPConfig(hla_decay="sometimes")
    with pytest.raises(ValueError, match="num_key_value_heads: expected a divisor"):
        HLASPConfig(num_attention_heads=4, num_key_value_heads=3)


def test_hf_package_imports_no_megatron():
    code = ("import sys, hla_sp.hf; bad = [m for m in sys.modules if m.startswith('megatron')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert hla_sp.hf.HLASPConfig.model_type == "hla_sp"

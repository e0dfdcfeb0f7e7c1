"""``--reset-attention-mask`` with HLA: the documents of a packed sample, from its EODs.

megatron-core's GPTModel with the HLA spec, fed :class:`DocumentParams` built from the
EOD tokens (what the entry point does under the flag): a document's logits are those
of the document run alone, whatever precedes it, at CP = 1 and at CP = 2 (documents
crossing the zigzag chunks). Megatron's own ``pretrain()`` with the flag is checked in
tests/integration/test_megatron_pretrain.py.

Tolerance (fp32): a document run alone and inside a pack runs the same recurrence with
other chunk boundaries (it starts mid-chunk in the pack) and, under CP, other shard
boundaries: the sums are associated differently, a few ulps per accumulation relative
to the terms summed. 2e-5 of the logits' largest magnitude (about 170 ulps) bounds that
with room; a document that sees its predecessor moves by 1e-2 and more (checked).
"""

from __future__ import annotations

import os
import re
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")
VOCAB, T, EOD = 64, 48, 63


def _scale_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    scale = max(b.abs().max().item(), 1e-30)
    torch.testing.assert_close(a, b, rtol=0, atol=2e-5 * scale, msg=what)


def test_offsets_are_megatrons_reset_mask():
    """The documents cut exactly where Megatron's reset attention mask does (EOD last in
    its document; an EOD at the end of a row starts nothing)."""
    from hla_sp.megatron_patch.documents import eod_offsets
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB - 1, (3, 20), generator=g)
    tokens[0, [4, 5, 12]] = EOD
    tokens[1, 19] = EOD
    tokens[2, 0] = EOD
    for row, off in zip(tokens, eod_offsets(tokens, EOD)):
        mask, _, pos = _get_ltor_masks_and_position_ids(row, EOD, True, True, False, True)
        doc = torch.repeat_interleave(torch.arange(len(off) - 1), off.diff())
        ours = (doc[:, None] == doc[None, :]) & torch.ones(20, 20).tril().bool()
        # Megatron's mask is True where attention is masked out
        assert torch.equal(ours, ~mask[0]), (row, off)
        starts = torch.zeros(20, dtype=torch.bool)
        starts[off[:-1]] = True
        assert torch.equal(starts, pos == 0), (row, off, pos)


def _setup(world_size: int) -> None:
    warnings.simplefilter("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(context_parallel_size=world_size)


def _model(world_size: int):
    from hla_sp.megatron_patch import get_hla_layer_local_spec
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=64, use_cpu_initialization=True, attention_dropout=0.0,
        hidden_dropout=0.0, context_parallel_size=world_size, bias_dropout_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False,
    )
    # the default HLA options: short convolution, learned decay, first-order path
    spec = get_hla_layer_local_spec("hla2", chunk_size=8)
    torch.manual_seed(1234)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=T, position_embedding_type="learned_absolute")


def _positions(tokens: torch.Tensor) -> torch.Tensor:
    """Megatron's --reset-position-ids: positions restart after each EOD."""
    from hla_sp.megatron_patch.documents import eod_offsets

    return torch.stack([torch.cat([torch.arange(int(n)) for n in off.diff()])
                        for off in eod_offsets(tokens, EOD)])


def _rows(first: int) -> torch.Tensor:
    """Two rows of T tokens: [doc1, EOD, doc2, EOD, doc3] and [doc4, EOD, doc5]; doc1
    (``first``: its seed) is 17 tokens, so doc2 starts mid-chunk and, at CP = 2 (chunks
    of 12), inside rank 0's first chunk and ends in rank 1's."""
    g = torch.Generator().manual_seed(5)
    rows = torch.randint(0, VOCAB - 1, (2, T), generator=g)
    doc1 = torch.Generator().manual_seed(first)
    rows[0, :17] = torch.randint(0, VOCAB - 1, (17,), generator=doc1)
    rows[0, [17, 33]] = EOD
    rows[1, 29] = EOD
    return rows


def doc_task(rank: int, world_size: int, first: int, state: dict | None,
             documents: bool = True) -> dict:
    """Logits [2, T, V] of the two rows (this rank's zigzag shard, with its positions)."""
    from hla_sp.megatron_patch.compat import cp_split
    from hla_sp.megatron_patch.documents import DocumentParams
    from megatron.core import parallel_state

    _setup(world_size)
    try:
        model = _model(world_size)
        if state is not None:
            model.load_state_dict(state)
        tokens = _rows(first)
        docs = DocumentParams.from_tokens(tokens, EOD) if documents else None
        batch = {"tokens": tokens, "position_ids": _positions(tokens),
                 "index": torch.arange(T).expand(2, T).contiguous()}
        batch = cp_split(batch, parallel_state.get_context_parallel_group())
        with torch.no_grad():
            logits = model(batch["tokens"], batch["position_ids"], None, packed_seq_params=docs)
        out = {"logits": logits, "index": batch["index"]}
        if state is None:
            out["state"] = {k: v.clone() for k, v in model.state_dict().items()
                            if isinstance(v, torch.Tensor)}
        return out
    finally:
        parallel_state.destroy_model_parallel()


def alone_task(rank: int, world_size: int, tokens: torch.Tensor, state: dict) -> torch.Tensor:
    """Logits of one document [1, n] run by itself (no documents, positions from 0)."""
    from megatron.core import parallel_state

    _setup(1)
    try:
        model = _model(1)
        model.load_state_dict(state)
        with torch.no_grad():
            return model(tokens, torch.arange(tokens.shape[1])[None], None)
    finally:
        parallel_state.destroy_model_parallel()


def _whole(outs: list[dict]) -> torch.Tensor:
    """Every rank's logits put back at their global positions."""
    logits = torch.full((2, T, VOCAB), float("nan"))
    for o in outs:
        for b in range(2):
            logits[b, o["index"][b]] = o["logits"][b]
    assert not logits.isnan().any()
    return logits


@pytest.fixture(scope="module")
def reference(world) -> dict:
    """CP = 1: the packed rows with doc1 drawn from seed 11, the weights."""
    return world(1).run(doc_task, 11, None)[0]


@pytest.mark.timeout(300)
def test_each_document_equals_the_document_alone(world, reference):
    packed = reference["logits"]
    tokens = _rows(11)
    for b, (s, e) in [(0, (0, 18)), (0, (18, 34)), (0, (34, T)), (1, (0, 30)), (1, (30, T))]:
        alone = world(1).run(alone_task, tokens[b:b + 1, s:e], reference["state"])[0]
        _scale_close(packed[b, s:e], alone[0], f"row {b} tokens {s}:{e}")
    # without the documents doc2 sees doc1: the probe can tell
    mixed = world(1).run(doc_task, 11, reference["state"], False)[0]["logits"]
    assert (mixed[0, 18:34] - packed[0, 18:34]).abs().max() > 1e-2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp", [1, 2])
def test_changing_doc1_leaves_the_other_documents(world, reference, cp):
    """doc1 drawn from another seed: only doc1's own logits change, at CP = 1 and 2."""
    other = _whole(world(cp).run(doc_task, 12, reference["state"]))
    packed = reference["logits"]
    assert (other[0, :18] - packed[0, :18]).abs().max() > 1e-2  # doc1 did change
    _scale_close(other[0, 18:], packed[0, 18:], "row 0 after doc1")
    _scale_close(other[1], packed[1], "row 1")


@pytest.mark.parametrize(("extra", "message"), [
    (["--hla-layer-pattern", "2", "--num-layers", "2"],
     "--reset-attention-mask with --attention hla2 --hla-layer-pattern 2: expected HLA in "
     "every layer"),
    (["--pipeline-model-parallel-size", "2"],
     "--reset-attention-mask with --attention hla2: expected --pipeline-model-parallel-size 1"),
])
def test_entry_point_refuses_where_the_documents_cannot_reach_hla(extra, message):
    """Hybrid stacks (megatron-core's softmax attention refuses packed params) and
    pipeline stages without the tokens: refused by name before anything is built."""
    from hla_sp.megatron_patch.routing import prescan

    with pytest.raises(ValueError, match=re.escape(message)):
        prescan(["--attention", "hla2", "--reset-attention-mask", *extra])
    prescan(["--attention", "hla2", *extra])  # the same without the flag is fine


def test_megatrons_own_script_refuses_reset_attention_mask(monkeypatch):
    """Megatron-LM's pretrain_gpt.py with ``--spec``: HLA would get only the [b, 1, s, s]
    mask, which it cannot read; the spec module refuses when Megatron imports it."""
    import argparse
    import sys
    import types

    from hla_sp.megatron_patch.guards import BypassError
    from megatron.core.transformer.spec_utils import import_module

    gv = types.ModuleType("megatron.training.global_vars")
    gv._GLOBAL_ARGS = argparse.Namespace(  # type: ignore[attr-defined]
        spec=["hla_sp.megatron_patch.specs", "hla2_layer_spec"], reset_attention_mask=True)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", gv)
    monkeypatch.delitem(sys.modules, "hla_sp.megatron_patch.specs", raising=False)
    with pytest.raises(BypassError, match="--reset-attention-mask with --spec hla_sp"):
        import_module(("hla_sp.megatron_patch.specs", "hla2_layer_spec"))
    gv._GLOBAL_ARGS.reset_attention_mask = False  # type: ignore[attr-defined]
    monkeypatch.delitem(sys.modules, "hla_sp.megatron_patch.specs", raising=False)
    assert import_module(("hla_sp.megatron_patch.specs", "hla2_layer_spec")) is not None


def test_documents_must_cover_the_rows(world, reference):
    """DocumentParams of other rows than the batch's: refused by name."""
    model_out = world(1).run(bad_rows_task, reference["state"])[0]
    assert "packed_seq_params.row_offsets: expected 2 rows of documents over 48 tokens" \
        in model_out, model_out


def bad_rows_task(rank: int, world_size: int, state: dict) -> str:
    from hla_sp.megatron_patch.documents import DocumentParams
    from megatron.core import parallel_state

    _setup(1)
    try:
        model = _model(1)
        model.load_state_dict(state)
        tokens = _rows(11)
        docs = DocumentParams.from_tokens(tokens[:, :40], EOD)  # 40 tokens, not 48
        try:
            with torch.no_grad():
                model(tokens, _positions(tokens), None, packed_seq_params=docs)
        except ValueError as e:
            return str(e)
        return "no error"
    finally:
        parallel_state.destroy_model_parallel()


def test_documents_are_planned_once_per_micro_batch(group, monkeypatch):
    """The first HLA layer plans the micro-batch's documents; the second reuses the plan
    (one host read per batch, not per layer)."""
    from hla_sp.megatron_patch.documents import DocumentParams
    from megatron.core import parallel_state

    import hla_sp.ops.sharding as sharding

    calls = []
    plan_documents = sharding.plan_documents
    monkeypatch.setattr(sharding, "plan_documents",
                        lambda *a, **k: calls.append(a) or plan_documents(*a, **k))
    _setup(1)
    try:
        model = _model(1)
        tokens = _rows(11)
        docs = DocumentParams.from_tokens(tokens, EOD)
        model(tokens, _positions(tokens), None, packed_seq_params=docs).sum().backward()
        assert len(calls) == 1, calls  # two layers, forward and backward
        assert calls[0][1] == 2 * T  # the two rows end to end
    finally:
        parallel_state.destroy_model_parallel()

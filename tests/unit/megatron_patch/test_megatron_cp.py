"""megatron-core GPTModel with the HLA spec: context parallelism reproduces one rank.

The batch is split by megatron-core's own ``get_batch_on_this_cp_rank`` (zigzag, called
through ``compat.cp_split`` with the CP group, as the entry point does); the HLA core
attention runs sequence parallelism on that split. Loss, logits and every parameter's
gradient (summed over the CP group, as Megatron's DDP reduction does) must match
CP = 1. TP = 2 x CP = 2 on 4 ranks must match TP = 1 x CP = 1 in loss and per-token loss.

Tolerance (fp32): the CP result differs from CP = 1 only in the order of floating-point
sums (the state carried across ranks is the same sum, associated differently) and the
chunk boundaries that move with the shard. Such reorderings cost a few ulps per
accumulation, relative to the size of the summed terms, so we allow 2e-5 of each
tensor's largest magnitude (about 170 fp32 ulps), plus rtol 1e-4.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from hla_sp.config import HLA_OPERATORS

megatron_core = pytest.importorskip("megatron.core")
VOCAB, T = 64, 48


def _setup(world_size: int, tp: int = 1) -> None:
    warnings.simplefilter("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=world_size // tp
    )


def _build(case: dict, world_size: int, tp: int = 1):
    from hla_sp.megatron_patch import get_hla_layer_local_spec
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4,
        num_query_groups=case["groups"], ffn_hidden_size=64, use_cpu_initialization=True,
        attention_dropout=0.0, hidden_dropout=0.0, context_parallel_size=world_size // tp,
        tensor_model_parallel_size=tp,
        bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
    )
    spec = get_hla_layer_local_spec(case["operator"], decay=case["decay"], chunk_size=8,
                                    **case.get("options", {}))
    torch.manual_seed(1234)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB,
                     max_sequence_length=T, position_embedding_type="learned_absolute")
    if case["decay"] == "data":  # the gate weight starts at zero; make it matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("decay_weight"):
                    p.normal_(std=1.0, generator=torch.Generator().manual_seed(7))
    return model


def _batch(case: dict) -> tuple[dict, object]:
    """The global batch (same on every rank) and the THD packed params or None."""
    from megatron.core.packed_seq_params import PackedSeqParams

    g = torch.Generator().manual_seed(99)
    B = 1 if case["thd"] else 2
    seq = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    batch = {
        "tokens": seq[:, :-1].contiguous(),
        "labels": seq[:, 1:].contiguous(),
        "loss_mask": (torch.rand(B, T, generator=g) > 0.1).float(),
        "index": torch.arange(T).expand(B, T).contiguous(),
    }
    params = None
    if case["thd"]:
        # Three documents; with CP = 2 and 4 their boundaries fall inside and across
        # the zigzag chunks, so documents cross ranks.
        cu = torch.tensor([0, 13, 31, T], dtype=torch.int32)
        pos = torch.cat([torch.arange(e - s) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())])
        batch["position_ids"] = pos[None]
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=18, max_seqlen_kv=18)
    else:
        batch["position_ids"] = torch.arange(T).expand(B, T).contiguous()
    return batch, params


def gpt_task(rank: int, world_size: int, case: dict, state: dict | None) -> dict:
    """Forward + backward of the GPT model on this rank's CP shard."""
    import torch.distributed as dist
    from hla_sp.megatron_patch import assert_hla_model
    from hla_sp.megatron_patch.compat import cp_split
    from megatron.core import parallel_state

    _setup(world_size)
    try:
        model = _build(case, world_size)
        assert_hla_model(model, case["operator"])
        if state is not None:
            model.load_state_dict(state)
        batch, params = _batch(case)
        n_tokens = batch["loss_mask"].sum()
        batch = cp_split(batch, parallel_state.get_context_parallel_group())
        logits = model(batch["tokens"], batch["position_ids"], None, packed_seq_params=params)
        ce = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, VOCAB), batch["labels"].reshape(-1), reduction="none"
        )
        loss = (ce * batch["loss_mask"].reshape(-1)).sum() / n_tokens
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        group = parallel_state.get_context_parallel_group()
        total = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(total, group=group)
            for gr in grads.values():
                dist.all_reduce(gr, group=group)
        out = {"loss": total.item(), "logits": logits.detach(), "index": batch["index"],
               "grads": grads if rank == 0 else None}
        if state is None:
            out["state"] = {k: v.clone() for k, v in model.state_dict().items()
                            if isinstance(v, torch.Tensor)}
        return out
    finally:
        parallel_state.destroy_model_parallel()


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    scale = max(b.abs().max().item(), 1e-30)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5 * scale, msg=what)


CASES = {
    "gqa-hla2-learned": dict(operator="hla2", groups=2, decay="learned", thd=False),
    "mha-hla3-data": dict(operator="hla3", groups=4, decay="data", thd=False),
    "mqa-ahla-none": dict(operator="ahla", groups=1, decay="none", thd=False),
    "thd-gqa-hla2-fixed": dict(operator="hla2", groups=2, decay="fixed", thd=True),
}
# Every other higher-order operator of the table, grouped, at CP = 2.
CASES.update({f"gqa-{op}-learned": dict(operator=op, groups=2, decay="learned", thd=False)
              for op in HLA_OPERATORS if op not in {c["operator"] for c in CASES.values()}})


@pytest.fixture(scope="module")
def references(world):
    """CP = 1 results (and the weights every CP run loads), computed once per case."""
    return {name: world(1).run(gpt_task, case, None)[0] for name, case in CASES.items()}


# Every case at CP = 2; at CP = 4 the GQA and THD cases only (time on a 2-core CPU).
CP_RUNS = [(name, 2) for name in CASES] + [("gqa-hla2-learned", 4), ("thd-gqa-hla2-fixed", 4)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, cp", CP_RUNS, ids=[f"{n}-{c}" for n, c in CP_RUNS])
def test_cp_matches_single_rank(world, references, name, cp):
    ref = references[name]
    outs = world(cp).run(gpt_task, CASES[name], ref["state"])
    assert abs(outs[0]["loss"] - ref["loss"]) <= 1e-5 * max(1.0, abs(ref["loss"]))
    # Put every rank's logits back at their global positions.
    logits = torch.empty_like(ref["logits"])
    seen = torch.zeros(ref["logits"].shape[:2], dtype=torch.bool)
    for o in outs:
        for b in range(logits.shape[0]):
            logits[b, o["index"][b]] = o["logits"][b]
            seen[b, o["index"][b]] = True
    assert seen.all()
    _close(logits, ref["logits"], "logits")
    grads = outs[0]["grads"]
    assert set(grads) == set(ref["grads"])
    for n, g in ref["grads"].items():
        _close(grads[n], g, f"grad of {n}")
    # The HLA parameters do get gradient (decay and norms are trained under CP).
    hla = [n for n in grads if ".core_attention." in n]
    assert hla and all(grads[n].abs().sum() > 0 for n in hla), hla


def tp_cp_task(rank: int, world_size: int, tp: int, case: dict) -> dict:
    """Per-token loss (Megatron's vocab-parallel cross entropy) at TP = tp, CP = world/tp.

    No state is loaded: with ``use_cpu_initialization`` Megatron draws every weight whole
    and splits it, so one seed gives the same model at every TP size.
    """
    import torch.distributed as dist
    from hla_sp.megatron_patch.compat import cp_split
    from megatron.core import parallel_state

    _setup(world_size, tp)
    try:
        model = _build(case, world_size, tp)
        batch, params = _batch(case)
        n_tokens = batch["loss_mask"].sum()
        batch = cp_split(batch, parallel_state.get_context_parallel_group())
        per_token = model(batch["tokens"], batch["position_ids"], None,
                          labels=batch["labels"], packed_seq_params=params)
        loss = (per_token.float() * batch["loss_mask"]).sum() / n_tokens
        loss.backward()
        total = loss.detach().clone()
        if world_size // tp > 1:
            dist.all_reduce(total, group=parallel_state.get_context_parallel_group())
        return {"loss": total.item(), "per_token": per_token.detach(), "index": batch["index"],
                "tp_rank": parallel_state.get_tensor_model_parallel_rank()}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.timeout(600)
def test_tp2_cp2_matches_tp1_cp1(world):
    """4 gloo ranks, TP = 2 x CP = 2: the heads split over TP (GQA: one KV group per
    rank), the sequence over CP; loss and every token's loss equal TP = 1 x CP = 1."""
    # The defaults, short convolution included: its q, k, v taps are drawn for all TP
    # ranks and cut by heads, so TP = 2 starts from TP = 1's model.
    case = CASES["gqa-hla2-learned"]
    ref = world(1).run(tp_cp_task, 1, case)[0]
    outs = world(4).run(tp_cp_task, 2, case)
    per_token = torch.full_like(ref["per_token"], float("nan"))
    for o in outs:
        assert abs(o["loss"] - ref["loss"]) <= 1e-5 * max(1.0, abs(ref["loss"])), (o, ref)
        for b in range(per_token.shape[0]):
            if o["tp_rank"] == 1:  # TP ranks hold the same tokens: check they agree
                torch.testing.assert_close(per_token[b, o["index"][b]], o["per_token"][b],
                                           rtol=1e-5, atol=1e-5)
            per_token[b, o["index"][b]] = o["per_token"][b]
    _close(per_token, ref["per_token"], "per-token loss")

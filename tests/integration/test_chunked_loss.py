"""The chunked output projection + cross-entropy (:mod:`hla_sp.launch.model.loss`)
equals the plain path: in fp64 to 1e-10 at TP 1 and TP 2 (loss, hidden, weight and a
tied embedding's gradients; an uneven last chunk, masked tokens, padded vocabulary), and
in a short fp32 training run; the memory planner's logits term falls with it."""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")
VOCAB, PADDED, H, S, B = 45, 48, 8, 13, 2  # 26 tokens: chunks of 4 leave 2 at the end
CHUNK = 4


def _problem(rank: int, tp: int) -> dict:
    """A tied model in fp64, identical on every rank: an embedding table [PADDED, H]
    looked up by tokens, a mixing matrix, and the same table as output weight; labels
    and a loss mask with zeros."""
    g = torch.Generator().manual_seed(3)
    table = torch.randn(PADDED, H, generator=g, dtype=torch.float64).requires_grad_()
    mix = torch.randn(H, H, generator=g, dtype=torch.float64).requires_grad_()
    tokens = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = torch.randint(0, VOCAB, (B, S), generator=g)
    mask = (torch.rand(B, S, generator=g) > 0.3).double()
    return {"table": table, "mix": mix, "tokens": tokens, "labels": labels, "mask": mask}


def _grads(p: dict, loss: torch.Tensor) -> dict:
    (loss * p["mask"]).sum().backward()
    return {"loss": loss.detach(), "table": p["table"].grad.clone(), "mix": p["mix"].grad.clone()}


def _reference(p: dict) -> dict:
    """The plain path on one rank: all logits, the softmax over the real ids."""
    hidden = torch.tanh(p["table"][p["tokens"]] @ p["mix"])  # [b, s, h]
    logits = hidden @ p["table"].t()
    loss = torch.nn.functional.cross_entropy(
        logits[..., :VOCAB].reshape(-1, VOCAB), p["labels"].reshape(-1), reduction="none")
    return _grads(p, loss.view(B, S))


def fp64_task(rank: int, world_size: int) -> dict:
    """The chunked loss at TP = world_size, the embedding vocabulary-parallel as in
    Megatron (this rank's rows, all-reduced), against the one-rank reference."""
    warnings.simplefilter("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from hla_sp.launch.model.loss import chunked_cross_entropy
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        group = parallel_state.get_tensor_model_parallel_group() if world_size > 1 else None
        p = _problem(rank, world_size)
        width = PADDED // world_size
        rows = p["table"][rank * width:(rank + 1) * width]
        local = p["tokens"] - rank * width
        here = (local >= 0) & (local < width)
        embedded = rows[local.clamp(0, width - 1)] * here[..., None]
        if group is not None:
            embedded = reduce_from_tensor_model_parallel_region(embedded, group=group)
        hidden = torch.tanh(embedded @ p["mix"]).transpose(0, 1)  # [s, b, h]
        loss = chunked_cross_entropy(hidden, rows, p["labels"], CHUNK, VOCAB, rank, group)
        got = _grads(p, loss)
        ref = _reference(_problem(rank, world_size))
        return {"got": got, "ref": ref, "rows": (rank * width, (rank + 1) * width)}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [1, 2])
def test_fp64_loss_and_gradients_equal_the_plain_path(world, tp):
    for o in world(tp).run(fp64_task):
        got, ref, (a, b) = o["got"], o["ref"], o["rows"]
        close = {"rtol": 1e-10, "atol": 1e-12}
        torch.testing.assert_close(got["loss"], ref["loss"], **close)
        # the mixing matrix sees the whole hidden gradient (all-reduced over TP)
        torch.testing.assert_close(got["mix"], ref["mix"], **close)
        # this rank's table rows: embedding and output gradients; the other rows are
        # the other ranks' (zero here), padding rows get nothing
        torch.testing.assert_close(got["table"][a:b], ref["table"][a:b], **close)
        assert not got["table"][:a].any() and not got["table"][b:].any()
        assert not got["table"][VOCAB:].any()


def test_refuses_bad_arguments():
    from hla_sp.launch.model.loss import chunked_cross_entropy

    h, w, lab = torch.zeros(S, B, H), torch.zeros(PADDED, H), torch.zeros(B, S, dtype=torch.long)
    with pytest.raises(ValueError, match=r"chunk: expected an int >= 1 .*got 0"):
        chunked_cross_entropy(h, w, lab, 0, VOCAB)
    with pytest.raises(ValueError, match=r"labels: expected shape \[b, s\] = \[2, 13\], got"):
        chunked_cross_entropy(h, w, lab.t(), CHUNK, VOCAB)
    with pytest.raises(ValueError, match=r"hidden, weight: expected"):
        chunked_cross_entropy(h, w[:, :3], lab, CHUNK, VOCAB)


MODEL_FLAGS = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
               "--seq-length", "8", "--vocab-size", str(VOCAB)]


def model_task(rank: int, world_size: int) -> dict:
    """The trainer's model with --loss-chunk-tokens 3: logits without labels, the
    chunked per-token losses with them."""
    warnings.simplefilter("ignore")
    from hla_sp.launch.config.train_config import parse_args
    from hla_sp.launch.model.build import build_model
    from hla_sp.launch.model.loss import _ChunkedPost
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    try:
        torch.manual_seed(0)
        model = build_model(parse_args([*MODEL_FLAGS, "--loss-chunk-tokens", "3"]), VOCAB)
        tokens = torch.randint(0, VOCAB, (2, 8))
        pos = torch.arange(8).expand(2, 8)
        with torch.no_grad():
            return {"chunked": isinstance(model._postprocess, _ChunkedPost),
                    "tokens": tokens, "logits": model(tokens, pos, None),
                    "loss": model(tokens, pos, None, labels=tokens)}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.timeout(300)
def test_model_uses_it_only_with_labels(world):
    """build_model installs it (auto above 4096 tokens, or the flag); called without
    labels the model still returns logits [b, s, V] for generation and export."""
    from hla_sp.launch.config.train_config import parse_args
    from hla_sp.launch.model.estimate import loss_chunk_tokens

    assert loss_chunk_tokens(parse_args(MODEL_FLAGS)) == 0  # 8 tokens: nothing to save
    assert loss_chunk_tokens(parse_args([*MODEL_FLAGS, "--seq-length", "8192"])) == 4096
    cfg = parse_args([*MODEL_FLAGS, "--loss-chunk-tokens", "3"])
    assert cfg.to_dict()["model"]["loss_chunk_tokens"] == 3  # recorded in config.json
    o = world(1).run(model_task)[0]
    assert o["chunked"]
    assert o["logits"].shape == (2, 8, 128)
    plain = torch.nn.functional.cross_entropy(
        o["logits"][..., :VOCAB].reshape(-1, VOCAB), o["tokens"].reshape(-1), reduction="none")
    # fp32: the same logits, summed in another order (~1e-7 relative)
    torch.testing.assert_close(o["loss"], plain.view(2, 8), rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(600)
def test_training_losses_equal_the_plain_path(tmp_path):
    from hla_sp.launch.distributed.local import run_local

    tiny = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "64", "--train-iters", "4", "--lr", "3e-3", "--seed", "7",
            "--micro-batch-size", "2", "--eval-interval", "2", "--eval-iters", "1"]
    runs = [run_local([*tiny, "--loss-chunk-tokens", str(n)], 1, str(tmp_path / f"{n}.jsonl"),
                      timeout=300) for n in (0, 24)]  # 128 tokens: 5 chunks of 24, one of 8
    for r in runs:
        assert r.returncode == 0, r.output[-3000:]
    plain, chunked = runs[0].losses, runs[1].losses
    assert len(plain) == len(chunked) == 4
    # fp32 both: the same products summed in another order (per chunk, the weight's
    # gradient accumulated over chunks), ~1e-7 relative per step, grown by four steps
    for a, b in zip(plain, chunked):
        assert math.isclose(a, b, rel_tol=1e-5), (plain, chunked)
    # validation (no gradient) goes through the chunked loss too
    val = [[r["val_loss"] for r in run.records if "val_loss" in r] for run in runs]
    assert len(val[0]) == len(val[1]) == 2, val
    for a, b in zip(*val):
        assert math.isclose(a, b, rel_tol=1e-5), val


def test_planner_counts_the_chunked_logits():
    """The README's cluster command: the plain path's logits (12 B x 50,304 ids x 65,536
    tokens, 36.8 GiB) dominate its activations; chunked, a layer's working set does."""
    from hla_sp.launch.config.train_config import parse_args
    from hla_sp.launch.model.estimate import GIB, estimate

    cluster = ["--context-parallel-size", "16", "--seq-length", "1048576", "--num-layers", "24",
               "--hidden-size", "2048", "--num-attention-heads", "16",
               "--position-embedding-type", "none", "--bf16", "--recompute-granularity", "full",
               "--vocab-size", "50257"]
    plain = estimate(parse_args([*cluster, "--loss-chunk-tokens", "0"]), 16)
    auto = estimate(parse_args(cluster), 16)
    tokens, saved = 65536, 24 * 2 * 2048  # full recompute: one bf16 input per layer
    assert plain.activation_bytes == tokens * saved + tokens * 12 * 50304
    # 173 B per token per unit of width in fp32, half in bf16
    assert auto.activation_bytes == tokens * saved + tokens * 173 * 2048 * 2 // 4
    assert plain.activation_bytes - auto.activation_bytes > 25 * GIB
    small = estimate(parse_args([*cluster, "--loss-chunk-tokens", "65536"]), 16)
    assert small.activation_bytes == plain.activation_bytes  # one chunk: all logits


def test_bf16_matches_the_plain_path_to_bf16_rounding():
    """bf16 weights and hidden states, as under --bf16: the logits' matmul is the plain
    path's (bf16, then fp32), so the losses agree to fp32 summation order; the weight's
    gradient is summed over chunks in fp32 and rounded once, the plain path's in one bf16
    matmul, so they differ by bf16 rounding (2^-8 relative, a few of them)."""
    from hla_sp.launch.model.loss import chunked_cross_entropy

    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(S, B, H, generator=g).bfloat16().requires_grad_()
    weight = torch.randn(PADDED, H, generator=g).bfloat16().requires_grad_()
    labels = torch.randint(0, VOCAB, (B, S), generator=g)
    dloss = torch.rand(B, S, generator=g)
    loss = chunked_cross_entropy(hidden, weight, labels, CHUNK, VOCAB)
    dh, dw = torch.autograd.grad((loss * dloss).sum(), (hidden, weight))
    logits = (hidden @ weight.t()).float()[..., :VOCAB]  # [s, b, V]
    plain = torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), labels.t().reshape(-1), reduction="none").view(S, B).t()
    rh, rw = torch.autograd.grad((plain * dloss).sum(), (hidden, weight))
    assert loss.dtype == torch.float32 and dh.dtype == dw.dtype == torch.bfloat16
    torch.testing.assert_close(loss, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dh.float(), rh.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dw.float(), rw.float(), rtol=2e-2, atol=2e-2)

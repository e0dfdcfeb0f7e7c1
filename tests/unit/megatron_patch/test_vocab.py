"""Padded vocabulary rows take no probability (:mod:`hla_sp.megatron_patch.vocab`).

The trainer's GPTModel (``hla_sp.launch.model.build.build_model``) pads 257 ids to 384 rows
(TP 1) or 512 (TP 2) with the default ``--make-vocab-size-divisible-by 128``; its logits
at the padding ids are -inf, in each TP rank's vocabulary slice, so the loss is the
softmax over the real ids whatever the padding rows hold, and those rows get no
gradient. The resumed-at-another-TP check is in tests/unit/launch/checkpoint/test_sharded.py.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")
VOCAB = 257
FLAGS = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--vocab-size", str(VOCAB)]


def test_padding_columns():
    from hla_sp.megatron_patch.vocab import padding_columns

    assert padding_columns(257, 0, 384) == 257  # TP 1
    assert padding_columns(257, 0, 256) == 256  # TP 2, rank 0: no padding
    assert padding_columns(257, 256, 256) == 1  # TP 2, rank 1: all but id 256
    assert padding_columns(100, 128, 128) == 0  # a slice of padding only


def test_mask_padded_vocab_refuses_a_bad_vocabulary():
    from hla_sp.megatron_patch.vocab import mask_padded_vocab

    with pytest.raises(ValueError, match="vocab_size: expected an int >= 1"):
        mask_padded_vocab(torch.nn.Linear(2, 2), 0)


def padding_task(rank: int, world_size: int) -> dict:
    """The trainer's model at TP = world_size: logits, per-token loss, then the same with
    the padding rows overwritten by large values; the padding rows' gradient."""
    warnings.simplefilter("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from hla_sp.launch.config.train_config import parse_args
    from hla_sp.launch.model.build import build_model
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        cfg = parse_args([*FLAGS, "--tensor-model-parallel-size", str(world_size)])
        model = build_model(cfg, VOCAB)
        g = torch.Generator().manual_seed(0)
        seq = torch.randint(0, VOCAB, (2, 17), generator=g)
        tokens, labels = seq[:, :-1], seq[:, 1:]
        pos = torch.arange(16).expand(2, 16)
        table = model.embedding.word_embeddings.weight  # this rank's rows (tied output)
        first = rank * table.shape[0]
        pad = slice(max(0, VOCAB - first), table.shape[0])
        logits = model(tokens, pos, None).detach()
        loss = model(tokens, pos, None, labels=labels)
        loss.sum().backward()
        pad_grad = table.grad[pad].abs().max().item() if table.grad[pad].numel() else 0.0
        with torch.no_grad():
            table[pad] = 50.0 * torch.randn(table[pad].shape, generator=g)
            moved = model(tokens, pos, None, labels=labels)
        return {"logits": logits, "loss": loss.detach(), "moved": moved, "pad": pad,
                "pad_grad": pad_grad, "rows": table.shape[0]}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [1, 2])
def test_padding_ids_take_no_probability(world, tp):
    outs = world(tp).run(padding_task)
    assert sum(o["rows"] for o in outs) == (384 if tp == 1 else 512)
    for rank, o in enumerate(outs):
        logits, pad = o["logits"], o["pad"]
        assert torch.isneginf(logits[..., pad]).all(), rank
        assert torch.isfinite(logits[..., :pad.start]).all(), rank
        # the loss over the real ids does not see the padding rows at all
        assert torch.equal(o["moved"], o["loss"]), rank
        assert o["pad_grad"] == 0.0, rank
    if tp == 1:  # the per-token loss is the softmax over the 257 real ids
        o = outs[0]
        seq = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
        ref = torch.nn.functional.cross_entropy(
            o["logits"][..., :VOCAB].reshape(-1, VOCAB), seq[:, 1:].reshape(-1),
            reduction="none").reshape(2, 16)
        torch.testing.assert_close(o["loss"], ref, rtol=1e-6, atol=1e-6)

"""Model FLOP counts (hla_sp.launch.model.flops): hand counts, and what the launcher reports."""

from __future__ import annotations

import pytest
from hla_sp.launch.model.flops import attention_flops_per_token, gpt_flops_per_token


def test_softmax_is_causal_and_grows_with_T() -> None:
    # T / 2 keys a query on average, 2 FLOPs a multiply-add, scores and mixing: T (K + V)
    assert attention_flops_per_token("softmax", 8192, 16, 16, 128) == 8192 * 256 * 16
    assert attention_flops_per_token("softmax", 32768, 16, 16, 128) == \
        4 * attention_flops_per_token("softmax", 8192, 16, 16, 128)


def test_linear_is_one_pass_independent_of_T() -> None:
    K, C, H = 128, 64, 16
    one = 2 * K * K * H + (2 * K * K + C * 2 * K) * H  # update, read-out, intra-chunk
    assert attention_flops_per_token("linear", 8192, H, H, K, C) == one
    assert attention_flops_per_token("linear", 10**6, H, H, K, C) == one
    # GQA: the state update is per kv head, the read-out per query head
    assert attention_flops_per_token("linear", 8192, H, 4, K, C) == \
        2 * K * K * 4 + (2 * K * K + C * 2 * K) * H


def test_hla2_is_two_passes_of_the_primitive() -> None:
    # S [K, K] on the kv heads, H [K, V] on the query heads; eta (1-D) not counted
    assert attention_flops_per_token("hla2", 8192, 16, 16, 128) == \
        2 * attention_flops_per_token("linear", 8192, 16, 16, 128)
    assert attention_flops_per_token("hla2", 8192, 16, 4, 128) == pytest.approx(
        attention_flops_per_token("linear", 8192, 16, 4, 128)
        + attention_flops_per_token("linear", 8192, 16, 16, 128))


def test_gpt_count_by_hand_and_hla_below_softmax_at_32k() -> None:
    h, L, V, T = 1024, 8, 32000, 32768
    got = gpt_flops_per_token(layers=L, hidden=h, heads=8, kv_heads=4, ffn=4 * h, vocab=V,
                              seq_length=T, attention="softmax")
    d = h // 8
    matmul = h * (h + 2 * 4 * d) + h * h + 2 * h * 4 * h
    assert got == 3 * (L * (2 * matmul + T * 2 * d * 8) + 2 * h * V)
    hla = gpt_flops_per_token(layers=L, hidden=h, heads=8, kv_heads=4, ffn=4 * h, vocab=V,
                              seq_length=T, attention="hla2")
    assert hla < got


@pytest.mark.parametrize("bad", [
    dict(attention="nope"), dict(seq_length=0), dict(kv_heads=3), dict(head_dim=True)])
def test_bad_arguments_are_refused_in_one_line(bad: dict) -> None:
    args = dict(attention="hla2", seq_length=64, heads=4, kv_heads=2, head_dim=16) | bad
    with pytest.raises(ValueError) as e:
        attention_flops_per_token(**args)
    assert "\n" not in str(e.value) and str(e.value).split(":")[0] in {
        "operator", "seq_length", "kv_heads", "head_dim"}


def test_launcher_uses_the_same_count() -> None:
    from hla_sp.launch.config.train_config import parse_args
    from hla_sp.launch.model.estimate import model_flops_per_token

    cfg = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                      "--seq-length", "256"])
    m = cfg.model.make_vocab_size_divisible_by
    assert model_flops_per_token(cfg, 257) == gpt_flops_per_token(
        layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=m * -(-257 // m),
        seq_length=256, attention=cfg.model.attention)

"""The key moment S = sum k k^T passes k as the value too (hla2, hla3, ccq): k's two
gradients, as the key and as the value, are summed in the dq/dk kernel's epilogue in
fp32, not by an autograd add over [B, T, H, K] afterwards."""

from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, K, T = 2, 16, 40


def _inputs(G: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(G)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen).to(DEVICE)

    return dict(q=r(1, T, H * G, K), k=r(1, T, H, K) * 0.5, g=-0.2 * r(1, T, H).abs(),
                h0=r(1, H, K, K), do=r(1, T, H * G, K), dht=r(1, H, K, K))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("G", [1, 2], ids=["mha", "gqa"])
def test_kernels_sum_k_gradients(interpreted: None, G: int, dtype: torch.dtype) -> None:
    """chunk_backward(v_is_k=True): dk is the key's plus the value's gradient of the call
    with a separate v, dv is None, and dq, dg, dh0 are bit for bit those of that call.
    The sum is made in fp32 and rounded once, so against the two rounded gradients of
    the separate call it differs by at most their two roundings (2^-8 each in bf16)."""
    from hla_sp import kernels

    x = _inputs(G)
    q, k, do = (x[n].to(dtype) for n in ("q", "k", "do"))
    args = (x["g"], None, x["h0"], do, x["dht"], 16)
    dq, dk, dv, dg, dh0 = kernels.chunk_backward(q, k, k.clone(), *args)
    one = kernels.chunk_backward(q, k, k, *args, v_is_k=True)
    assert one[2] is None
    want = dk.float() + dv.float()
    ulp = 1e-6 if dtype == torch.float32 else 2.0**-8
    err = (one[1].float() - want).abs()
    assert bool((err <= 2 * ulp * (dk.float().abs() + dv.float().abs()) + 1e-6).all())
    for a, b in zip((dq, dg, dh0), (one[0], one[3], one[4]), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("G", [1, 2], ids=["mha", "gqa"])
def test_autograd_gives_k_one_gradient(interpreted: None, monkeypatch: pytest.MonkeyPatch,
                                       G: int) -> None:
    """Through the operator, k passed as both key and value reaches the kernels as
    ``v_is_k`` and gets one gradient (the operator returns none for v), equal to the sum
    of the two of a separate v."""
    from hla_sp.ops import chunk_op
    from hla_sp.ops.primitive import chunk_linear_attention_triton

    seen: list[bool] = []
    real = chunk_op.triton_chunk_backward

    def spy(*a: object, **kw: object) -> object:
        seen.append(bool(a[-1]))  # v_is_k, the last positional argument
        return real(*a, **kw)

    monkeypatch.setattr(chunk_op, "triton_chunk_backward", spy)
    x = _inputs(G)
    k1 = x["k"].clone().requires_grad_()
    k2, v2 = x["k"].clone().requires_grad_(), x["k"].clone().requires_grad_()
    for k, v in ((k1, k1), (k2, v2)):
        o, _ = chunk_linear_attention_triton(x["q"], k, v, x["g"], h0=x["h0"], chunk_size=16,
                                             scale=0.5)
        (o * x["do"]).sum().backward()
    assert seen == [True, False]
    want = k2.grad + v2.grad
    assert float((k1.grad - want).abs().max()) <= 1e-5 * float(want.abs().max())

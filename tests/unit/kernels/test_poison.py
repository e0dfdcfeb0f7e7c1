"""Document isolation on the Triton path: flags raised by the kernels, poison put back by
one gated launch per direction (``hla_sp.kernels._flags``, ``hla_sp.kernels.poison``).

The torch path's flags (``hla_sp.ops.isolation``) are the reference: on the same
inputs, with one non-finite value put in q, k, v, h0, the outputs' cotangent or the
final state's, both paths must give NaN at exactly the same places of o, h_T and of
every gradient, and agree elsewhere to fp32 rounding. Runs under Triton's interpreter
on CPU (``TRITON_INTERPRET=1``), on the GPU with CUDA.
"""

from __future__ import annotations

import pytest
import torch

import hla_sp
from hla_sp.ops.dispatch import use_backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAN, INF = float("nan"), float("inf")
H, K, V = 2, 16, 16


def _run(backend: str, T: int, cu: list[int] | None, G: int, poison: tuple, *,
         reset: int | None = None, chunk: int = 16) -> list[torch.Tensor]:
    """o, h_T and the gradients of q, k, v, the decay and h0 of one linear_attention
    call with one non-finite value ``poison`` = (where, token, head, value)."""
    gen = torch.Generator().manual_seed(0)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen)

    n = 1 if cu is None else len(cu) - 1
    x = dict(q=r(1, T, H * G, K) * 0.5, k=r(1, T, H, K) * 0.5, v=r(1, T, H, V),
             g=-torch.rand(1, T, H, generator=gen) * 0.3, h0=r(n, H, K, V),
             do=r(1, T, H * G, V), dht=r(n, H, K, V))
    if reset is not None:
        x["g"][0, reset, 1] = -INF  # a hard reset in head 1
    where, t, h, value = poison
    if where is not None:
        x[where][(0, t, h, 1) if where not in ("h0", "dht") else (t, h, 1, 2)] = value
    x = {name: val.to(DEVICE) for name, val in x.items()}
    leaves = [x[name].clone().requires_grad_() for name in ("q", "k", "v", "g", "h0")]
    cus = None if cu is None else torch.tensor(cu, device=DEVICE)
    with use_backend(backend):
        o, st = hla_sp.linear_attention(*leaves[:3], log_decay=leaves[3],
                                        initial_state=leaves[4], output_final_state=True,
                                        cu_seqlens=cus, chunk_size=chunk)
        ((o * x["do"]).sum() + (st * x["dht"]).sum()).backward()
    return [t.detach().cpu() for t in (o, st, *(leaf.grad for leaf in leaves))]


NAMES = ["o", "h_T", "dq", "dk", "dv", "dg", "dh0"]
POISONS = {
    "v-nan": ("v", 10, 0, NAN), "k-inf": ("k", 25, 1, INF), "q-nan": ("q", 30, 0, NAN),
    "v-neginf": ("v", 45, 1, -INF), "h0-nan": ("h0", 0, 1, NAN), "do-nan": ("do", 33, 1, NAN),
    "dht-inf": ("dht", 0, 0, INF), "finite": (None, 0, 0, 0.0),
}


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert torch.equal(a.isnan(), b.isnan()), f"{name}: NaN at other places than torch's"
        a, b = a.nan_to_num(), b.nan_to_num()
        # both fp32, summing at most T products of O(1) terms in other orders
        tol = 1e-5 * max(1.0, float(b.abs().max()))
        assert float((a - b).abs().max()) <= tol, name


@pytest.mark.parametrize("poison", list(POISONS), ids=str)
@pytest.mark.parametrize(("G", "cu"), [(1, [0, 20, 50]), (2, [0, 20, 50]), (1, None)],
                         ids=["docs", "docs-gqa", "plain"])
def test_poison_where_torch_puts_it(interpreted: None, poison: str, G: int, cu: list | None
                                    ) -> None:
    """NaN exactly where the torch path's flags put it, with documents, a hard reset
    (head 1, token 35), multi-query heads, an initial and a final state."""
    args = (50, cu, G, POISONS[poison])
    _assert_same(_run("triton", *args, reset=35), _run("torch", *args, reset=35))


ACROSS = {
    # a flag in block 0 carried forward through block 1 into block 2 (document at 100)
    "v-nan-30": ("v", 30, 0, NAN, [0, 100, 150]),
    # block 1, the reverse carry back into block 0 (the backward's whole segment)
    "do-nan-70": ("do", 70, 1, NAN, [0, 100, 150]),
    "v-nan-70": ("v", 70, 1, NAN, [0, 100, 150]),
    # the states' words carried over every block, without documents
    "h0-nan": ("h0", 0, 1, NAN, None),
    "dht-inf": ("dht", 0, 0, INF, None),
}


@pytest.mark.parametrize("case", list(ACROSS), ids=str)
def test_poison_across_scan_blocks(interpreted: None, case: str) -> None:
    """T = 150: the poison kernels scan T in blocks of 64, carrying the segment's state
    from block to block, forward and backward."""
    where, t, h, value, cu = ACROSS[case]
    args = (150, cu, 1, (where, t, h, value))
    _assert_same(_run("triton", *args), _run("torch", *args))


def test_flags_of_finite_inputs_cost_nothing(interpreted: None) -> None:
    """Finite inputs raise no flag, and isolation changes no bit of any output or
    gradient: the kernels with flags equal the kernels without."""
    from hla_sp import kernels

    gen = torch.Generator().manual_seed(1)
    T = 40
    q, k, v = (torch.randn(1, T, H, K, generator=gen).to(DEVICE) for _ in range(3))
    g = (-0.2 * torch.rand(1, T, H, generator=gen)).to(DEVICE)
    h0, dht = (torch.randn(1, H, K, V, generator=gen).to(DEVICE) for _ in range(2))
    do = torch.randn(1, T, H, V, generator=gen).to(DEVICE)
    flags = kernels.new_flags(1, T, H, q.device)
    plain = kernels.chunk_forward(q, k, v, g, None, h0, 16)
    isolated = kernels.chunk_forward(q, k, v, g, None, h0, 16, flags)
    assert not bool(flags.any()), "a flag raised for finite inputs"
    grads = kernels.chunk_backward(q, k, v, g, None, h0, do, dht, 16)
    grads_isolated = kernels.chunk_backward(q, k, v, g, None, h0, do, dht, 16, flags)
    for a, b in zip((*plain, *grads), (*isolated, *grads_isolated), strict=True):
        assert torch.equal(a, b)


def test_flags_name_the_token_and_head(interpreted: None) -> None:
    """A NaN in v at (token 7, head 1) raises that token's flag and that head's gate
    word; an inf in h0 of head 0 raises head 0's state word and gate."""
    from hla_sp import kernels

    T = 20
    q, k, v = (torch.randn(1, T, H, K).to(DEVICE) for _ in range(3))
    h0 = torch.randn(1, H, K, V).to(DEVICE)
    v[0, 7, 1, 3] = NAN
    h0[0, 0, 4, 5] = INF
    flags = kernels.new_flags(1, T, H, q.device)
    kernels.chunk_forward(q, k, v, None, None, h0, 16, flags)
    want = torch.zeros(1, T + 2, H, dtype=torch.int32)
    want[0, 7, 1] = 1  # the token
    want[0, T, 0] = 1  # h0 of head 0
    want[0, T + 1, :] = 1  # both heads' gates
    assert torch.equal(flags.cpu(), want)

"""torch.compile(fullgraph=True) of a small model built on hla2 and linear_attention.

The primitive is a ``torch.library`` custom operator while compiling (see
:mod:`hla_sp.ops.primitive`): these tests check that the graph has no break, that the
operator is in it once per primitive call, that outputs and every gradient equal
eager mode, and the operator's registration itself (``torch.library.opcheck``).
Runs on CPU with the torch path; one case runs the Triton path under the interpreter.
"""

from __future__ import annotations

import copy

import pytest
import torch

import hla_sp
from hla_sp.config import BUILTIN_OPERATORS
from hla_sp.ops.primitive import chunk_linear_attention_op

H, K, V = 2, 16, 16


class Tiny(torch.nn.Module):
    """Projections, then linear_attention + hla2 with a learned per-head decay."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 2 * H * K + H * V)
        self.log_decay = torch.nn.Parameter(-torch.rand(H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.proj(x).split([H * K, H * K, H * V], dim=-1)
        q, k, v = q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, V)
        o1, h1 = hla_sp.linear_attention(
            q, k, v, log_decay=self.log_decay, output_final_state=True, chunk_size=16
        )
        o2, st = hla_sp.hla2(
            q, k, v, log_decay=self.log_decay, output_final_state=True, chunk_size=16
        )
        return (o1 * o2).sum() + h1.square().sum() + st.S.mean() + st.H.mean()


def count_op_backend(counter: dict[str, int]) -> object:
    """aot_eager, after counting the custom operator's nodes in the dynamo graph."""
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        counter["graphs"] += 1
        counter["ops"] += sum(
            1 for n in gm.graph.nodes
            if n.op == "call_function" and "hla_sp.chunk_linear_attention" in str(n.target)
        )
        return aot_eager(gm, example_inputs)

    return backend


def grads_of(model: torch.nn.Module, x: torch.Tensor, fn: object) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = fn(x)  # type: ignore[operator]
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compile_fullgraph(
    monkeypatch: pytest.MonkeyPatch, backend: str, num_threads: int
) -> None:
    """The compiled model's loss and gradients err against the fp64 model by at most
    twice what eager mode's do (flash-attention's rule, per tensor in max norm): the
    same fp32 computation, whatever order the compiled graph sums in."""
    if backend == "triton":
        if torch.cuda.is_available():
            pytest.skip("the interpreter case is for CPU machines")
        pytest.importorskip("triton")  # the test's precondition, not its subject
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HLA_SP_BACKEND", backend)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(1, 37, 32)
    eager = grads_of(model, x, model)
    counter = {"graphs": 0, "ops": 0}
    compiled = torch.compile(model, fullgraph=True, backend=count_op_backend(counter))
    if backend == "triton":
        import hla_sp.kernels as kernels

        before = sum(kernels.LAUNCHES.values())
    got = grads_of(model, x, compiled)
    assert counter == {"graphs": 1, "ops": 3}, counter  # 1 + 2 primitive calls, one graph
    if backend == "triton":
        assert sum(kernels.LAUNCHES.values()) > before
    monkeypatch.setenv("HLA_SP_BACKEND", "torch")  # the fp64 truth: the torch path
    model64 = copy.deepcopy(model).double()
    truth = grads_of(model64, x.double(), model64)
    for name, a, b, t in zip(["loss", "dW", "db", "dlog_decay"], got, eager, truth):
        err, eager_err = (float((y.double() - t).abs().max()) for y in (a, b))
        assert err <= 2 * eager_err, (name, err, eager_err)


def test_compile_checks_log_decay_in_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """The log_decay <= 0 check survives compilation (as an in-graph assert)."""
    monkeypatch.setenv("HLA_SP_BACKEND", "torch")
    torch._dynamo.reset()

    def f(q: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return hla_sp.linear_attention(q, q, q, log_decay=a)[0]

    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    q = torch.randn(1, 8, H, K)
    cf(q, -torch.rand(H))
    with pytest.raises(RuntimeError, match="log_decay"):
        cf(q, torch.rand(H) + 0.1)


@pytest.mark.parametrize("with_optional", [False, True], ids=["plain", "g-resets-h0"])
def test_opcheck(monkeypatch: pytest.MonkeyPatch, with_optional: bool) -> None:
    """Schema, fake implementation and autograd registration of the operator."""
    torch.manual_seed(1)
    B, T = 1, 20
    q = torch.randn(B, T, H, K, requires_grad=True)
    k = torch.randn(B, T, H, K, requires_grad=True)
    v = torch.randn(B, T, H, V, requires_grad=True)
    g = resets = h0 = None
    if with_optional:
        g = (-torch.rand(B, T, H)).requires_grad_()
        resets = torch.zeros(B, T, dtype=torch.bool)
        resets[0, 9] = True
        h0 = torch.randn(B, H, K, V, requires_grad=True)
    torch.library.opcheck(chunk_linear_attention_op, (q, k, v, g, resets, h0, 16, "torch"))


def _dense_chunk(q, k, v, g, *, resets, h0, chunk_size):  # chunk_size: same signature
    """Plain-autograd reference of the chunk scan in fp64: the T x T decayed, masked
    score matrix (segments cut at ``resets``) and the carry of h0 into segment 0."""
    q, k, v, g, h0 = (x.double() for x in (q, k, v, g, h0))
    A = g.cumsum(1).transpose(1, 2)  # [B, H, T]
    seg = resets.long().cumsum(1)[:, None]  # [B, 1, T] segment of each token
    T = q.shape[1]
    keep = torch.ones(T, T, dtype=torch.bool).tril() & (seg[..., :, None] == seg[..., None, :])
    D = torch.exp((A[..., :, None] - A[..., None, :]).masked_fill(~keep, float("-inf")))
    Q, Kk, Vv = (x.transpose(1, 2) for x in (q, k, v))
    o = ((Q @ Kk.transpose(-1, -2)) * D) @ Vv
    o = o + (torch.exp(A) * (seg == 0))[..., None] * (Q @ h0)
    last = (seg == seg[..., -1:]).to(A.dtype)
    w = torch.exp(A[..., -1:] - A) * last
    h = (Kk * w[..., None]).transpose(-1, -2) @ Vv
    h = h + (torch.exp(A[..., -1]) * (seg[..., -1] == 0))[..., None, None] * h0
    return o.transpose(1, 2), h


def test_op_gradients_match_autograd() -> None:
    """The operator's hand-written backward equals plain autograd of a dense fp64
    reference (decay, a reset, h0 and a final-state cotangent)."""
    torch.manual_seed(2)
    B, T = 1, 21
    xs = [
        torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V),
        -torch.rand(B, T, H), torch.randn(B, H, K, V),
    ]
    do, dht = torch.randn(B, T, H, V), torch.randn(B, H, K, V)
    resets = torch.zeros(B, T, dtype=torch.bool)
    resets[0, 5] = True

    def grads(fn: object, dtype: torch.dtype) -> list[torch.Tensor]:
        leaves = [x.to(dtype).requires_grad_() for x in xs]
        o, h = fn(*leaves[:4], resets=resets, h0=leaves[4], chunk_size=16)  # type: ignore[operator]
        ((o * do.to(o.dtype)).sum() + (h * dht.to(h.dtype)).sum()).backward()
        return [o.detach(), h.detach()] + [x.grad for x in leaves]

    from hla_sp.ops.primitive import make_chunk_impl

    got = grads(make_chunk_impl("torch"), torch.float64)
    ref = grads(_dense_chunk, torch.float64)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert (a - b).abs().max() <= 1e-10 * b.abs().max(), i


def _state_sum(st: tuple) -> torch.Tensor:
    """The sum of every tensor of a layer's state (the operator's and the conv's)."""
    parts = [*st.op, st.conv] if hasattr(st, "conv") else list(st)
    return sum(t.sum() for t in parts if t is not None)


@pytest.mark.parametrize("short_conv,documents", [(0, True), (4, True), (4, False)],
                         ids=["documents", "conv-documents", "conv-rows"])
def test_compile_layer_with_batch_plan(
    monkeypatch: pytest.MonkeyPatch, short_conv: int, documents: bool
) -> None:
    """HLAttention (GQA, first-order path, learned decay, with or without the short
    convolution) over packed documents given as a batch plan, or over batch rows,
    traces as one graph: the plan's offsets are Python constants and nothing is read
    on the host. Loss and gradients (the final states' included) err against the fp64
    layer by at most twice what eager fp32 does (the rule of test_compile_fullgraph:
    the same fp32 computation, summed in another order by the compiled graph), plus
    one fp32 rounding of the largest value (where eager happens to be exact)."""
    from hla_sp.nn import HLAttention
    from hla_sp.ops.sharding import plan_documents

    monkeypatch.setenv("HLA_SP_BACKEND", "torch")
    torch._dynamo.reset()
    torch.manual_seed(0)
    T = 24
    plan = plan_documents([0, 5, 13, T], T) if documents else None
    layer = HLAttention(16, 4, 4, num_kv_heads=2, short_conv=short_conv, chunk_size=8)
    with torch.no_grad():
        torch.nn.init.normal_(layer.heads.key_mix)
    x = torch.randn(1 if documents else 2, T, 16)

    def loss_of(m: torch.nn.Module) -> object:
        def f(x: torch.Tensor) -> torch.Tensor:
            y, st = m(x, plan=plan, output_final_state=True)
            return y.square().sum() + _state_sum(st)
        return f

    eager = grads_of(layer, x, loss_of(layer))
    counter = {"graphs": 0, "ops": 0}
    compiled = torch.compile(loss_of(layer), fullgraph=True, backend=count_op_backend(counter))
    got = grads_of(layer, x, compiled)
    assert counter["graphs"] == 1 and counter["ops"] == 2, counter  # hla2's two stages
    layer64 = copy.deepcopy(layer).double()
    truth = grads_of(layer64, x.double(), loss_of(layer64))
    assert len(got) == len(truth) == 1 + len(list(layer.parameters()))  # the loss, every grad
    for i, (a, b, t) in enumerate(zip(got, eager, truth)):
        err, eager_err = (float((y.double() - t).abs().max()) for y in (a, b))
        floor = 2.0**-24 * float(t.abs().max())
        assert err <= 2 * eager_err + floor, (i, err, eager_err)


@pytest.mark.parametrize("op", list(BUILTIN_OPERATORS))
def test_compile_layer_of_every_operator(monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    """Every built-in operator of the table traces in the layer (GQA, the first-order
    path, packed documents as a batch plan) as one graph, and the compiled fp64 loss
    and gradients equal eager mode's (the same operations: 1e-12 relative)."""
    from hla_sp.nn import HLAttention
    from hla_sp.ops.sharding import plan_documents

    monkeypatch.setenv("HLA_SP_BACKEND", "torch")
    torch._dynamo.reset()
    torch.manual_seed(0)
    T = 20
    plan = plan_documents([0, 7, T], T)
    layer = HLAttention(16, 4, 4, num_kv_heads=2, operator=op, chunk_size=8).double()
    with torch.no_grad():
        for p in (layer.heads.key_mix, layer.heads.value_mix):
            if p is not None:
                torch.nn.init.normal_(p)
    x = torch.randn(1, T, 16, dtype=torch.float64)

    def f(x: torch.Tensor) -> torch.Tensor:
        y, st = layer(x, plan=plan, output_final_state=True)
        return y.square().sum() + _state_sum(st)

    eager = grads_of(layer, x, f)
    counter = {"graphs": 0, "ops": 0}
    got = grads_of(layer, x, torch.compile(f, fullgraph=True, backend=count_op_backend(counter)))
    assert counter["graphs"] == 1 and counter["ops"] >= 1, counter
    for i, (a, b) in enumerate(zip(got, eager)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * float(b.abs().max()),
                                   msg=lambda m, i=i: f"tensor {i}: {m}")

"""The operator table (hla_sp.ops.operators): a new operator is one entry, its stages and
its reference.

The toy operator here, o = LA(q, k, LA(q, q, v)) (its inner stage reads the queries as
keys), is registered by the tests alone and removed after each: the config accepts it,
the functional call and the layer run it forward and backward (GQA and the first-order
value mix included), it equals its serial reference in fp64, and under
SequenceParallel on 2 gloo ranks each rank's shard equals the one-process call.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from hla_sp import config
from hla_sp.ops import operators
from hla_sp.ops.runner import run_operator
from hla_sp.ops.stages import StageContext

TOY = "toy_qqv"
F64 = torch.float64
TOL = 1e-10


class ToyState(NamedTuple):
    """A [N, Hq, K, V] (inner: sum q v^T) and H [N, Hq, K, V] (outer)."""

    A: torch.Tensor
    H: torch.Tensor


def toy_stages(ctx: StageContext, qs, k, v, state0):
    """u = LA(q, q, v), then o = LA(q, k, u): both stages per query head."""
    A0, H0 = state0
    u, A = ctx.per_head(qs, qs, ctx.expand(v), A0)
    o, H = ctx.per_head(qs, ctx.expand(k), ctx.value(u, v), H0)
    return o, [A, H]


def toy(q, k, v, **kw):
    """The toy's public function: the table's runner under its name."""
    return run_operator(TOY, q, k, v, **kw)


def toy_reference(q, k, v, log_decay=None, scale=None, initial_state=None):
    """A_t = g A + q_t v_t^T, u_t = A_t^T q_t, H_t = g H + k_t u_t^T, o_t = H_t^T q_t."""
    B, T, H, K = q.shape
    qs = q * (K**-0.5 if scale is None else scale)
    g = torch.zeros(B, T, H, dtype=q.dtype) if log_decay is None else torch.broadcast_to(
        log_decay, (B, T, H))
    A = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state[0]
    Hs = torch.zeros_like(A) if initial_state is None else initial_state[1]
    out = []
    for t in range(T):
        gam = torch.exp(g[:, t])[..., None, None]
        A = gam * A + qs[:, t, :, :, None] * v[:, t, :, None, :]
        u = torch.einsum("bhk,bhkv->bhv", qs[:, t], A)
        Hs = gam * Hs + k[:, t, :, :, None] * u[:, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", qs[:, t], Hs))
    return torch.stack(out, 1), (A, Hs)


SPEC = operators.OperatorSpec(
    TOY, ToyState, (operators.Field("A", "q", ("K", "V")), operators.Field("H", "q", ("K", "V"))),
    toy_stages, public=toy, reference=toy_reference, value_mix=True, higher_order=False)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _inputs(B=2, T=13, Hq=2, Hkv=2, K=4, V=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    g = -torch.rand(B, T, Hkv, generator=gen, dtype=F64) * 0.4
    return r(B, T, Hq, K), r(B, T, Hkv, K), r(B, T, Hkv, V), g


def test_config_copy_matches_the_table() -> None:
    assert tuple(operators.TABLE) == config.OPERATORS
    assert {n: s.facts() for n, s in operators.TABLE.items()} == config.BUILTIN_OPERATORS
    higher = tuple(n for n, s in operators.TABLE.items() if s.higher_order)
    assert higher == config.HLA_OPERATORS


def test_register_is_undone() -> None:
    with pytest.raises(ValueError, match="operator: expected one of"):
        config.HLAConfig(operator=TOY)
    with operators.registered(SPEC):
        assert config.HLAConfig(operator=TOY).operator == TOY
        with pytest.raises(ValueError, match="normalize: only operator 'hla2' has it"):
            config.HLAConfig(operator=TOY, normalize=True)
        with pytest.raises(ValueError, match="name: expected a new operator name"):
            operators.register(SPEC)
        assert operators.state_fields(TOY, 3, 4, 2, 5, 6) == {"A": (3, 4, 5, 6),
                                                              "H": (3, 4, 5, 6)}
    assert TOY not in operators.TABLE and TOY not in config.operator_names()
    with pytest.raises(ValueError, match="name: expected a registered operator"):
        operators.unregister("hla2")


def test_scale_in_kernels_must_be_a_bool() -> None:
    """The flag was a callable once: a leftover lambda would read as true; refused."""
    import dataclasses

    with pytest.raises(TypeError, match="scale_in_kernels: expected a bool"):
        operators.register(dataclasses.replace(SPEC, scale_in_kernels=lambda o: False))
    assert TOY not in operators.TABLE


def test_toy_equals_its_reference_fp64() -> None:
    """Output, final state and every gradient against the serial reference."""
    q, k, v, g = _inputs()
    h0 = [torch.randn(2, 2, 4, 3, dtype=F64) * 0.5 for _ in range(2)]
    with operators.registered(SPEC):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, *h0)]
        o, st = SPEC.public(*leaves[:3], log_decay=leaves[3], initial_state=tuple(leaves[4:]),
                            output_final_state=True, chunk_size=4)
        assert isinstance(st, ToyState)
        ref = [t.clone().requires_grad_() for t in (q, k, v, g, *h0)]
        o_ref, st_ref = SPEC.reference(*ref[:3], ref[3], initial_state=tuple(ref[4:]))
    w = torch.randn_like(o)
    for out in ((o, st), (o_ref, st_ref)):
        loss = (out[0] * w).sum() + sum((s * (i + 1)).sum() for i, s in enumerate(out[1]))
        loss.backward()
    assert _rel(o, o_ref) <= TOL
    for a, b in zip(st, st_ref):
        assert _rel(a, b) <= TOL
    for name, a, b in zip(("q", "k", "v", "g", "A0", "H0"), leaves, ref):
        assert _rel(a.grad, b.grad) <= TOL, name


def test_toy_in_the_layer_with_groups_and_mix() -> None:
    """GQA with the value mix equals the per-head call on repeated k, v; the layer runs
    forward and backward, and its decode steps continue its forward exactly."""
    from hla_sp.nn import HLAttention

    q, k, v, g = _inputs(Hq=4, Hkv=2)
    mix = torch.linspace(-1.0, 1.0, 4, dtype=F64)
    with operators.registered(SPEC):
        o, st = run_operator(TOY, q, k, v, log_decay=g, value_mix=mix,
                                 output_final_state=True, chunk_size=4)
        o2, st2 = run_operator(TOY, q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2),
                                   log_decay=g.repeat_interleave(2, -1), value_mix=mix,
                                   output_final_state=True, chunk_size=4)
        assert _rel(o, o2) <= TOL and all(_rel(a, b) <= TOL for a, b in zip(st, st2))

        torch.manual_seed(0)
        m = HLAttention(16, 4, 4, 2, operator=TOY, chunk_size=4).double()
        assert m.heads.value_mix is not None and m.heads.key_mix is None
        with torch.no_grad():
            m.heads.value_mix.normal_()
        x = torch.randn(2, 9, 16, dtype=F64)
        y = m(x)[0]
        y.square().sum().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all()
                   for p in m.parameters())
        with torch.no_grad():
            s5 = m(x[:, :5], output_final_state=True)[1]
            steps = []
            for t in range(5, 9):
                y_t, s5 = m.step(x[:, t], s5)
                steps.append(y_t)
        assert _rel(torch.stack(steps, 1), y[:, 5:].detach()) <= TOL


def _sp_task(rank: int, world_size: int) -> dict[str, float]:
    """Each rank: the one-process result, then its shard's under SequenceParallel."""
    from hla_sp.nn import HLAttention
    from hla_sp.parallel import SequenceParallel, shard

    sp = SequenceParallel()
    errs = {}
    with operators.registered(SPEC):
        q, k, v, g = _inputs(B=1, T=16)
        gen = torch.Generator().manual_seed(2)  # replicated: the same on every rank
        h0 = tuple(torch.randn(1, 2, 4, 3, dtype=F64, generator=gen) for _ in range(2))
        o, st = toy(q, k, v, log_decay=g, initial_state=h0, output_final_state=True,
                    chunk_size=4)
        part = [shard(t, rank, world_size, "contiguous") for t in (q, k, v, g)]
        o_sp, st_sp = toy(*part[:3], log_decay=part[3], initial_state=h0,
                          output_final_state=True, chunk_size=4, sp=sp)
        errs["op"] = max(_rel(o_sp, shard(o, rank, world_size, "contiguous")),
                         *(_rel(a, b) for a, b in zip(st_sp, st)))

        torch.manual_seed(0)
        m = HLAttention(16, 4, 4, 2, operator=TOY, chunk_size=4).double()
        with torch.no_grad():
            m.heads.value_mix.normal_()
        x = torch.randn(1, 16, 16, dtype=F64, generator=torch.Generator().manual_seed(3))
        y = m(x)[0]
        y.square().sum().backward()  # the global loss, which the ranks' losses sum to
        ref = {n: p.grad.clone() for n, p in m.named_parameters()}
        m.zero_grad()
        y_sp = m(shard(x, rank, world_size, "contiguous"), sp=sp)[0]
        y_sp.square().sum().backward()
        errs["layer"] = _rel(y_sp, shard(y, rank, world_size, "contiguous"))
        grads = {n: p.grad for n, p in m.named_parameters()}
    return errs, ref, grads


@pytest.mark.timeout(600)
def test_toy_under_sequence_parallel(world) -> None:
    results = world(2).run(_sp_task, timeout=540)
    for errs, _, _ in results:
        assert all(e <= TOL for e in errs.values()), errs
    ref = results[0][1]
    for n, want in ref.items():  # the ranks' gradients sum to the one-process gradient
        got = sum(r[2][n] for r in results)
        assert _rel(got, want) <= TOL, n

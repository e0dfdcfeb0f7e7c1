"""hla_sp.nn: the GQA-shared operators, the layer, decay, norms and streaming decode."""

from __future__ import annotations

import math

import pytest
import torch

from hla_sp import HLA2State, hla2
from hla_sp.nn import DECAYS, OPERATORS, HLAHeads, HLAttention, retnet_log_decay
from hla_sp.ops import LinearState, operators, run_operator

F64 = torch.float64


def _inputs(B=2, T=37, Hq=6, Hkv=2, K=5, V=4, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, K, generator=g, dtype=dtype)
    k = torch.randn(B, T, Hkv, K, generator=g, dtype=dtype)
    v = torch.randn(B, T, Hkv, V, generator=g, dtype=dtype)
    a = -torch.rand(B, T, Hkv, generator=g, dtype=dtype) * 0.2
    return q, k, v, a


def _options(op):
    return dict(normalize=True, ridge=0.3) if "normalize" in operators.get(op).options else {}


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "varlen"])
@pytest.mark.parametrize(("op", "mixed"), [(op, False) for op in OPERATORS]
                         + [(op, True) for op in OPERATORS
                            if operators.get(op).key_mix or operators.get(op).value_mix],
                         ids=lambda x: {True: "first-order", False: "pure"}.get(x, x))
def test_gqa_shared_state_equals_per_head(op, packed, mixed):
    """S (and C, h) computed once per group equals the per-head computation on
    repeated k, v: outputs, every input gradient, and the final state."""
    q, k, v, a = _inputs(B=1 if packed else 2)
    cu = torch.tensor([0, 11, 12, 37]) if packed else None
    G = q.shape[2] // k.shape[2]
    if mixed:
        w = torch.linspace(-1.0, 2.0, q.shape[2], dtype=F64)
        spec = operators.get(op)
        mix = {"key_mix": w if spec.key_mix else None,
               "value_mix": -w if spec.value_mix else None}
    else:
        mix = {}
    leaves = [t.clone().requires_grad_() for t in (q, k, v, a)]
    o, st = run_operator(op, *leaves[:3], log_decay=leaves[3], output_final_state=True,
                             cu_seqlens=cu, chunk_size=8, **_options(op), **mix)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, a)]
    rq, rk, rv, ra = ref_leaves
    o_ref, st_ref = run_operator(
        op, rq, rk.repeat_interleave(G, 2), rv.repeat_interleave(G, 2),
        log_decay=ra.repeat_interleave(G, -1), output_final_state=True, cu_seqlens=cu,
        chunk_size=8, **_options(op), **mix)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(o)
    (o * w).sum().backward()
    (o_ref * w).sum().backward()
    for name, x, y in zip("qkva", leaves, ref_leaves):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-9, atol=1e-9, msg=name)
    for field, s, r in zip(st._fields, st, st_ref):
        if s is None:
            assert r is None
            continue
        if s.shape[1] != r.shape[1]:  # shared field: one state per group
            assert s.shape[1] == k.shape[2], field
            r = r[:, ::G]
        torch.testing.assert_close(s, r, rtol=1e-10, atol=1e-10, msg=field)


@pytest.mark.parametrize("op", ["hla2", "ahla", "hla3"])
def test_first_order_path_is_the_sum_of_the_operators(op):
    """With weights a (key) and b (value) the layer's operator is exactly
    LA + a hla2 (hla2), LA + b ahla (ahla), LA + a hla2 + b ahla + ab hla3 (hla3),
    each term from the public operators: outputs and the final H."""
    from hla_sp import ahla, hla3, linear_attention

    q, k, v, a = _inputs(Hq=3, Hkv=3)
    g = torch.Generator().manual_seed(3)
    wk, wv = torch.randn(3, generator=g, dtype=F64), torch.randn(3, generator=g, dtype=F64)
    key_mix = wk if op in ("hla2", "hla3") else None
    value_mix = wv if op in ("ahla", "hla3") else None
    o, st = run_operator(op, q, k, v, log_decay=a, key_mix=key_mix, value_mix=value_mix,
                             output_final_state=True, chunk_size=8)
    kw = dict(log_decay=a, output_final_state=True)
    lin, h_lin = linear_attention(q, k, v, **kw)
    o2, s2 = hla2(q, k, v, **kw)
    oa, sa = ahla(q, k, v, **kw)
    o3, s3 = hla3(q, k, v, **kw)
    A, Bv = wk[:, None], wv[:, None]  # per head, broadcast over [B, T, H, V]
    H_lin = h_lin
    if op == "hla2":
        ref, H_ref = lin + A * o2, H_lin + A[..., None] * s2.H
    elif op == "ahla":
        ref, H_ref = lin + Bv * oa, H_lin + Bv[..., None] * sa.H
    else:
        ref = lin + A * o2 + Bv * oa + A * Bv * o3
        H_ref = H_lin + A[..., None] * s2.H + Bv[..., None] * sa.H + (A * Bv)[..., None] * s3.H
    torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(st.H, H_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("op", ["hla2", "ahla", "hla3"])
def test_mix_norm_is_the_composition_with_unit_intermediates(op):
    """mix_norm: the outer stage reads k + a k~/|k~| and v + b u/|u| (eps inside the
    root), k~ and u from the public first-order operator; outputs, every gradient and
    the final H against that composition written out, fp64 to 1e-10, under GQA."""
    from hla_sp import linear_attention

    q, k, v, a = _inputs(Hq=4, Hkv=2, K=5, V=5)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, a)]
    wk = torch.tensor([0.7, -1.3, 0.2, 2.0], dtype=F64, requires_grad=True)
    wv = torch.tensor([-0.4, 0.9, 1.1, -2.2], dtype=F64, requires_grad=True)
    key_mix = wk if op in ("hla2", "hla3") else None
    value_mix = wv if op in ("ahla", "hla3") else None
    o, st = run_operator(op, *leaves[:3], log_decay=leaves[3], key_mix=key_mix,
                             value_mix=value_mix, mix_norm=True, output_final_state=True,
                             chunk_size=8)

    def unit(x):
        return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)

    qr, kr, vr, ar = [t.detach().clone().requires_grad_(True) for t in leaves]
    G = 2
    rep = lambda t: t.repeat_interleave(G, dim=2)  # noqa: E731
    ag = rep(ar)
    kt, _ = linear_attention(qr, rep(kr), rep(kr), log_decay=ag)
    u, _ = linear_attention(qr, rep(kr), rep(vr), log_decay=ag)
    key, val = rep(kr), rep(vr)
    if key_mix is not None:
        key = key + wk[:, None] * unit(kt)
    if value_mix is not None:
        val = val + wv[:, None] * unit(u)
    ref, h = linear_attention(qr, key, val, log_decay=ag, output_final_state=True)
    torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(st.H, h, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(o)
    mixes = [p for p in (key_mix, value_mix) if p is not None]
    got = torch.autograd.grad((o * w).sum(), [*leaves, *mixes])
    want = torch.autograd.grad((ref * w).sum(), [qr, kr, vr, ar, *mixes])
    for name, g1, g2 in zip(["q", "k", "v", "decay", "mix", "mix"], got, want):
        torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-10, msg=name)


def test_first_order_path_starts_first_order():
    """At initialisation the HLA layers compute exactly the linear layer (weights zero),
    and the weights get gradients, so the higher-order terms can grow."""
    torch.manual_seed(0)
    x = torch.randn(2, 21, 24, dtype=F64)
    lin = HLAttention(24, 4, 6, 2, operator="linear", chunk_size=8).double()
    for op in ("hla2", "ahla", "hla3"):
        m = HLAttention(24, 4, 6, 2, operator=op, chunk_size=8).double()
        m.load_state_dict(lin.state_dict(), strict=False)
        y, _ = m(x)
        torch.testing.assert_close(y, lin(x)[0], rtol=1e-12, atol=1e-12)
        y.pow(2).sum().backward()
        for p in (m.heads.key_mix, m.heads.value_mix):
            if p is not None:
                assert p.grad is not None and p.grad.abs().max() > 0, op
    assert HLAttention(24, 4, operator="hla2", first_order=False).heads.key_mix is None


def test_gqa_state_is_per_group():
    heads = HLAHeads(8, 2, 4, operator="hla3")
    layer_state = heads.init_state(3)
    st = layer_state.op
    assert st.S.shape == (3, 2, 4, 4) and st.C.shape == (3, 2, 4, 4) and st.H.shape == (3, 8, 4, 4)
    # The conv keeps the last W-1 inputs of q (8 heads), k and v (2 heads each).
    assert layer_state.conv.shape == (3, heads.short_conv - 1, (8 + 2 * 2) * 4)
    lin = HLAHeads(4, 1, 4, operator="linear", short_conv=0)
    assert isinstance(lin.init_state(1), LinearState)


def test_mha_path_is_the_public_operator():
    q, k, v, a = _inputs(Hq=2, Hkv=2)
    o, st = run_operator("hla2", q, k, v, log_decay=a, output_final_state=True, normalize=True)
    o2, st2 = hla2(q, k, v, log_decay=a, output_final_state=True, normalize=True)
    torch.testing.assert_close(o, o2, rtol=0, atol=0)
    assert isinstance(st, HLA2State)
    for a_, b_ in zip(st, st2):
        torch.testing.assert_close(a_, b_, rtol=0, atol=0)


def _layer(op, decay, Hq=4, Hkv=2, seed=0, **kw):
    torch.manual_seed(seed)
    m = HLAttention(24, Hq, 6, Hkv, operator=op, decay=decay, chunk_size=8, **kw).double()
    randomize_zero_inits(m.heads)
    return m


def randomize_zero_inits(heads: HLAHeads) -> None:
    """The data gate and the first-order weights start at zero, which would hide their
    paths from a test: give them values."""
    with torch.no_grad():
        for p in (heads.decay_weight, heads.key_mix, heads.value_mix):
            if p is not None:
                torch.nn.init.normal_(p, std=1.0)


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("op", OPERATORS)
def test_decode_equals_parallel_forward(op, decay):
    """step() token by token reproduces forward(); prefill + decode does too."""
    m = _layer(op, decay, normalize=op == "hla2")
    x = torch.randn(2, 19, 24, dtype=F64)
    y, _ = m(x)
    state = m.init_state(2)
    steps = []
    for t in range(x.shape[1]):
        y_t, state = m.step(x[:, t], state)
        steps.append(y_t)
    torch.testing.assert_close(torch.stack(steps, 1), y, rtol=1e-10, atol=1e-10)
    # Prefill 11 tokens in parallel, decode the rest.
    y_pre, state = m(x[:, :11], output_final_state=True)
    rest = []
    for t in range(11, x.shape[1]):
        y_t, state = m.step(x[:, t : t + 1], state)
        rest.append(y_t)
    torch.testing.assert_close(torch.cat([y_pre, *rest], 1), y, rtol=1e-10, atol=1e-10)


def test_decode_needs_the_state():
    m = _layer("hla2", "learned")
    x = torch.randn(2, 9, 24, dtype=F64)
    y, _ = m(x)
    y_cold, _ = m(x[:, 5:])  # without the carried state the outputs differ
    assert (y_cold - y[:, 5:]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="state"):
        m.step(x[:, 0], None)
    with pytest.raises(ValueError, match="x_t"):
        m.step(x[:, :2], m.init_state(2))


def test_decode_cost_does_not_grow_with_context():
    """The state has a fixed size: after 5 or 50 tokens it holds the same shapes."""
    m = _layer("hla3", "fixed")
    x = torch.randn(1, 50, 24, dtype=F64)
    _, s5 = m(x[:, :5], output_final_state=True)
    _, s50 = m(x, output_final_state=True)
    assert [t.shape for t in (*s5.op, s5.conv)] == [t.shape for t in (*s50.op, s50.conv)]


def test_decay_is_nonpositive_by_construction():
    heads = HLAHeads(4, 2, 8, decay="data")
    with torch.no_grad():
        heads.decay_bias.fill_(50.0)  # logsigmoid saturates at 0, never above
        heads.decay_weight.normal_(std=30.0)
    k = torch.randn(3, 10, 2, 8) * 10
    a = heads.log_decay(k)
    assert a.shape == (3, 10, 2) and (a <= 0).all() and torch.isfinite(a).all()
    learned = HLAHeads(4, 2, 8, decay="learned")
    torch.testing.assert_close(learned.log_decay(k), retnet_log_decay(2))
    fixed = HLAHeads(4, 4, 8, decay="fixed", head_offset=2, total_kv_heads=8)
    torch.testing.assert_close(fixed.log_decay(k), retnet_log_decay(8)[2:6])
    assert HLAHeads(4, 2, 8, decay="none").log_decay(k) is None


def test_retnet_schedule():
    a = retnet_log_decay(8).double()
    gamma = torch.exp(a)
    torch.testing.assert_close(1 - gamma, torch.exp2(-torch.linspace(5, 12, 8, dtype=F64)),
                               rtol=1e-6, atol=0)
    assert (a < 0).all()


def test_output_norm_and_qk_norm():
    # Without the conv, whose SiLU before the qk-norm would make the scale matter.
    m = _layer("hla2", "none", short_conv=0)
    x = torch.randn(1, 16, 24, dtype=F64)
    h = m.heads
    q = m.q_proj(x).view(1, 16, 4, 6)
    k = m.k_proj(x).view(1, 16, 2, 6)
    v = m.v_proj(x).view(1, 16, 2, 6)
    o, _ = h(q, k, v)
    raw_heads = HLAHeads(4, 2, 6, operator="hla2", decay="none", output_norm=False,
                         short_conv=0).double()
    with torch.no_grad():
        raw_heads.key_mix.copy_(h.key_mix)  # the same operator, without the norm
    raw, _ = raw_heads(q, k, v)
    with torch.no_grad():
        h.norm_weight.uniform_(0.5, 2.0)
    o, _ = h(q, k, v)
    want = raw * torch.rsqrt(raw.pow(2).mean(-1, keepdim=True) + h.norm_eps) * h.norm_weight
    torch.testing.assert_close(o, want, rtol=1e-9, atol=1e-12)
    # qk-norm makes the layer blind to the size of q and k.
    o2, _ = h(q * 7.0, k * 0.1, v)
    torch.testing.assert_close(o2, o, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(operator="softmax"), ValueError, "operator"),
        (dict(decay="exp"), ValueError, "decay"),
        (dict(num_kv_heads=3), ValueError, "num_kv_heads"),
        (dict(operator="ahla", normalize=True), ValueError, "normalize"),
        (dict(operator="hla3", ridge=0.1), ValueError, "ridge"),
        (dict(ridge=-1.0), ValueError, "ridge"),
        (dict(chunk_size=48), ValueError, "chunk_size"),
        (dict(qk_norm=1), TypeError, "qk_norm"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    base = dict(hidden_size=16, num_heads=4, head_dim=4, num_kv_heads=2)
    base.update(kwargs)
    with pytest.raises(exc, match=match):
        HLAttention(**base)


def test_bad_inputs():
    m = HLAttention(16, 4, 4, 2)
    with pytest.raises(ValueError, match="x"):
        m(torch.randn(2, 5, 15))
    with pytest.raises(ValueError, match="x"):
        m(torch.randn(2, 15))
    with pytest.raises(ValueError, match="k"):
        m.heads(torch.randn(1, 5, 4, 4), torch.randn(1, 5, 4, 4), torch.randn(1, 5, 2, 4))
    with pytest.raises(ValueError, match="k"):
        run_operator("hla2", torch.randn(1, 5, 4, 4), torch.randn(1, 5, 3, 4),
                         torch.randn(1, 5, 3, 4))


def test_varlen_documents_are_independent():
    m = _layer("hla2", "data")
    x = torch.randn(1, 30, 24, dtype=F64)
    cu = torch.tensor([0, 7, 30])
    y, _ = m(x, cu_seqlens=cu)
    y0, _ = m(x[:, :7])
    y1, _ = m(x[:, 7:])
    torch.testing.assert_close(y, torch.cat([y0, y1], 1), rtol=1e-10, atol=1e-10)


def test_small_model_learns_without_nan():
    """Ten Adam steps of a one-layer HLA language model on a fixed batch lower the loss."""
    torch.manual_seed(0)
    V, D, T = 32, 32, 256
    emb = torch.nn.Embedding(V, D)
    att = HLAttention(D, 4, 8, 2)  # the defaults
    head = torch.nn.Linear(D, V)
    params = [*emb.parameters(), *att.parameters(), *head.parameters()]
    opt = torch.optim.Adam(params, lr=1e-2)
    # A sequence with long-range structure: token t repeats token t - 64.
    base = torch.randint(0, V, (2, 64))
    seq = base.repeat(1, T // 64 + 1)[:, : T + 1]
    losses = []
    for _ in range(10):
        h = emb(seq[:, :-1])
        y, _ = att(h)
        logits = head(h + y)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), seq[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert math.isfinite(loss.item())
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses


def test_short_conv_is_a_causal_depthwise_conv_per_document():
    """ShortConv against torch's conv1d, document by document: zero before each start,
    or the carried inputs; the final state is each document's last W-1 inputs."""
    from hla_sp.nn.conv import ShortConv

    torch.manual_seed(0)
    conv = ShortConv([("x", 5, 5, 0)], 4).double()
    x = torch.randn(1, 13, 5, dtype=F64)
    bounds = [0, 2, 2, 9, 13]  # an empty document and one shorter than W-1
    carried = torch.randn(4, 3, 5, dtype=F64)
    y, final = conv(x, bounds=bounds, state=carried, want_final=True)
    w = conv.weight.flip(-1)[:, None, :]  # conv1d correlates: tap d reads x_{t-d}
    for n in range(len(bounds) - 1):
        a, b = bounds[n], bounds[n + 1]
        seq = torch.cat([carried[n], x[0, a:b]])  # [W-1 + len, C]
        if b > a:
            ref = torch.nn.functional.conv1d(seq.T[None], w, groups=5)[0].T
            torch.testing.assert_close(y[0, a:b], torch.nn.functional.silu(ref), rtol=1e-12,
                                       atol=1e-12)
        torch.testing.assert_close(final[n], seq[-3:], rtol=0, atol=0)
    y0, _ = conv(x, bounds=bounds)  # no carried inputs: zeros before each start
    assert (y0 - y).abs()[0, :2].max() > 1e-3 and (y0 - y).abs()[0, 6:9].max() == 0
    with pytest.raises(ValueError, match="initial_state"):
        conv(x, bounds=bounds, state=carried[:2])


def test_short_conv_one_sequence_per_row_is_the_gathered_taps():
    """Without documents the convolution is one conv1d over the buffer: outputs, final
    states and the gradients of x, the carried inputs and the weights equal those of the
    gathered taps (the documents path, one document), fp64 to 1e-12, with and without
    carried inputs, for T below and above W-1; its output is contiguous, stays in x's
    dtype under autocast, and an empty row set gives an empty output."""
    from hla_sp.nn.conv import ShortConv

    torch.manual_seed(0)
    conv = ShortConv([("x", 5, 5, 0)], 4).double()
    for T in (2, 11):
        for carried in (None, torch.randn(1, 3, 5, dtype=F64)):
            x = torch.randn(1, T, 5, dtype=F64, requires_grad=True)
            st = None if carried is None else carried.clone().requires_grad_(True)
            outs = []
            for bounds in (None, [0, T]):  # conv1d, then the gathered taps
                conv.zero_grad()
                x.grad = None
                if st is not None:
                    st.grad = None
                y, final = conv(x, bounds=bounds, state=st, want_final=True)
                (y * torch.arange(y.numel(), dtype=F64).view_as(y).sin()).sum().backward()
                outs.append([y, final, x.grad, conv.x.grad]
                            + ([] if st is None else [st.grad]))
            assert outs[0][0].is_contiguous()
            for a, b in zip(*outs, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    x = torch.randn(2, 6, 5)
    conv32 = ShortConv([("x", 5, 5, 0)], 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert conv32(x)[0].dtype == torch.float32
    assert conv32(x[:, :0])[0].shape == (2, 0, 5)


def test_short_conv_is_the_same_model_under_tensor_parallelism():
    """Each tensor-parallel rank's conv holds its heads' rows of the TP=1 weights, for q
    (query heads) and k, v (kv heads) alike, so TP=2 starts from TP=1's model."""
    torch.manual_seed(0)
    full = HLAHeads(4, 2, 3)
    for rank in range(2):
        torch.manual_seed(0)
        part = HLAHeads(2, 1, 3, head_offset=rank, total_kv_heads=2)
        for name, rows in (("q", 6), ("k", 3), ("v", 3)):
            want = getattr(full.conv, name)[rank * rows : (rank + 1) * rows]
            torch.testing.assert_close(getattr(part.conv, name), want, rtol=0, atol=0)

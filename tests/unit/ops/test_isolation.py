"""Document isolation: a NaN or an infinity in one document reaches no other document.

Packed documents (``cu_seqlens``) and hard resets (a log-decay of -inf) cut the
sequence into segments. A non-finite value in q, k, v or the decay of one segment
must not reach any other segment (outputs, final states, gradients), and within its
own segment no later token may reach an earlier output. Each test runs the same call
twice, clean and with one document poisoned, and compares everything the poison must
not reach bitwise (``torch.equal``), on every path: the PyTorch chunk path, the Triton
kernels (interpreted on CPU), the fused hla2, sequence parallelism (every exchange
method and layout, split and composed pieces) and the short convolution. Where the
documents are cut at chunk boundaries, the other documents are also compared bitwise
with each document run alone.

Also here, the smaller items of the same issue: the operators and the layer on meta
and fake tensors (shape propagation, FLOP counting), ``SequenceParallel`` on a rank
outside its group, and the inputs' gradients on a rank with an empty shard.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator

import pytest
import torch

import hla_sp
from hla_sp.config import SP_METHODS
from hla_sp.ops.dispatch import use_backend

H, K, V = 2, 16, 16
T = 64
CHUNK = 16
NAN, INF = float("nan"), float("inf")
# Document 1 crosses a chunk edge (16) and shares chunks with documents 0 and 2.
CU = [0, 24, 40, 64]
ALIGNED = [0, 16, 48, 64]  # every start on a chunk edge: comparable with running alone
POISON = {"CU": 30, "ALIGNED": 33}  # a token of document 1, mid-chunk
# (tensor, value): what is put at the poisoned token
KINDS = [("q", NAN), ("k", INF), ("v", NAN), ("v", -INF), ("k", NAN)]
OPS = {"la": hla_sp.linear_attention, "hla2": hla_sp.hla2, "ahla": hla_sp.ahla,
       "hla3": hla_sp.hla3}


def _inputs(seed: int = 0, T: int = T, dtype: torch.dtype = torch.float32) -> dict:
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x = dict(q=r(1, T, H, K) * 0.5, k=r(1, T, H, K) * 0.5, v=r(1, T, H, V),
             g=-torch.rand(1, T, H, generator=gen) * 0.3, w=r(1, T, H, V))
    return {n: t.to(dtype) for n, t in x.items()}


def _poisoned(x: dict, name: str, t: int, value: float, *, whole: bool = False) -> dict:
    y = {n: v.clone() for n, v in x.items()}
    if whole:
        y[name][0, t] = value
    else:
        y[name][0, t, 0, 1] = value  # one element of one head
    return y


def _run(op: str, x: dict, cu: list[int] | None, *, final: bool = True,
         fn: Callable | None = None, chunk: int = CHUNK, backward: bool = True, **kw) -> dict:
    """One forward and backward; the loss weighs every output and final state. Without
    ``backward`` the gradients are zeros."""
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g")}
    call = fn or OPS[op]
    cus = None if cu is None else torch.tensor(cu, dtype=torch.int64)
    o, st = call(leaves["q"], leaves["k"], leaves["v"], log_decay=leaves["g"],
                 cu_seqlens=cus, output_final_state=final, chunk_size=chunk, **kw)
    finals = [] if st is None else ([st] if isinstance(st, torch.Tensor)
                                    else [s for s in st if s is not None])
    loss = (o * x["w"]).sum()
    for f in finals:
        loss = loss + f.sum()
    if backward:
        loss.backward()
    else:
        for t in leaves.values():
            t.grad = torch.zeros_like(t)
    out = {"o": o.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}
    out["finals"] = [f.detach() for f in finals]
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def _check(got: dict, ref: dict, cu: list[int], doc: int, t: int,
           grads: bool = True) -> list[str]:
    """Everything of the documents other than ``doc`` equal; and doc's tokens before t."""
    bad = []
    for d, (s, e) in enumerate(itertools.pairwise(cu)):
        names = ["o"] + (["dq", "dk", "dv", "dg"] if grads else [])
        if d == doc:
            if not _same(got["o"][:, s:t], ref["o"][:, s:t]):
                bad.append(f"o of document {d} before the poisoned token {t}")
            continue
        for n in names:
            if not _same(got[n][:, s:e], ref[n][:, s:e]):
                bad.append(f"{n} of document {d}")
        for i, (f, fr) in enumerate(zip(got["finals"], ref["finals"])):
            if not _same(f[d], fr[d]):
                bad.append(f"final state {i} of document {d}")
    return bad


@pytest.fixture
def torch_backend() -> Iterator[None]:
    with use_backend("torch"):
        yield


@pytest.mark.parametrize(("name", "value"), KINDS, ids=lambda x: str(x))
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("layout", ["CU", "ALIGNED"])
def test_torch_path_documents(torch_backend: None, op: str, name: str, value: float,
                              layout: str) -> None:
    cu = CU if layout == "CU" else ALIGNED
    t = POISON[layout]
    x = _inputs()
    ref = _run(op, x, cu)
    got = _run(op, _poisoned(x, name, t, value), cu)
    bad = _check(got, ref, cu, 1, t)
    assert not bad, bad
    if layout == "ALIGNED":  # and each clean document as if it ran alone
        for d in (0, 2):
            s, e = cu[d], cu[d + 1]
            alone = _run(op, {n: v[:, s:e] for n, v in x.items()}, None)
            assert _same(got["o"][:, s:e], alone["o"]), d
            for f, fa in zip(got["finals"], alone["finals"]):
                assert _same(f[d : d + 1], fa), ("final", d)
            for n in ("dq", "dk", "dv", "dg"):
                if d == 2:
                    assert _same(got[n][:, s:e], alone[n]), (n, d)
                else:
                    # a packed document's final state (not the last one's) is summed by
                    # another route (one weighted K^T V) than a lone one's (the chunk
                    # scan): the gradients through it agree to rounding only
                    torch.testing.assert_close(got[n][:, s:e], alone[n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("name", "value"), KINDS[:3], ids=lambda x: str(x))
@pytest.mark.parametrize("op", ["la", "hla2"])
def test_torch_path_hard_reset(torch_backend: None, op: str, name: str, value: float) -> None:
    """A log-decay of -inf at token 40 cuts as a document start does; the poison at 30."""
    x = _inputs()
    x["g"][0, 40] = -INF
    ref = _run(op, x, None)
    got = _run(op, _poisoned(x, name, 30, value), None)
    for n in ("o", "dq", "dk", "dv", "dg"):
        assert _same(got[n][:, 40:], ref[n][:, 40:]), n
    assert _same(got["o"][:, :30], ref["o"][:, :30])
    for f, fr in zip(got["finals"], ref["finals"]):
        assert _same(f, fr)


@pytest.mark.parametrize("value", [NAN, INF], ids=str)
def test_poisoned_decay_inside_the_chunk_path(torch_backend: None, value: float) -> None:
    """The public calls refuse a NaN or +inf decay; the chunk path below them, which
    the layers and the sequence-parallel pieces share, still isolates one."""
    from hla_sp.ops.primitive import chunk_impl, local_primitive

    x = _inputs()
    with pytest.raises(ValueError, match="log_decay"):
        _run("la", _poisoned(x, "g", 30, value, whole=True), CU)

    def call(q, k, v, *, log_decay, cu_seqlens, output_final_state, chunk_size):
        return local_primitive(q, k, v, log_decay, bounds=tuple(cu_seqlens.tolist()),
                               want_final=output_final_state, chunk_size=chunk_size)

    assert chunk_impl(x["q"]) is not None
    ref = _run("la", x, CU, fn=call)
    got = _run("la", _poisoned(x, "g", 30, value, whole=True), CU, fn=call)
    bad = _check(got, ref, CU, 1, 30)
    assert not bad, bad


def test_nan_without_documents_stays_causal(torch_backend: None) -> None:
    """No documents at all: an inf at token 40 leaves o[:40] as it was."""
    x = _inputs()
    for op in OPS:
        ref = _run(op, x, None, final=False, chunk=64)
        got = _run(op, _poisoned(x, "k", 40, INF), None, final=False, chunk=64)
        assert _same(got["o"][:, :40], ref["o"][:, :40]), op


def test_nan_in_the_initial_state(torch_backend: None) -> None:
    """A NaN in one document's initial state stays in that document."""
    x = _inputs()
    h0 = torch.randn(3, H, K, V)
    bad = h0.clone()
    bad[1, 0, 2, 3] = NAN
    ref = _run("la", x, CU, initial_state=h0)
    got = _run("la", x, CU, initial_state=bad)
    for d in (0, 2):
        s, e = CU[d], CU[d + 1]
        for n in ("o", "dq", "dk", "dv", "dg"):
            assert _same(got[n][:, s:e], ref[n][:, s:e]), (n, d)
        assert _same(got["finals"][0][d], ref["finals"][0][d])


# Triton kernels (interpreted on CPU) ---------------------------------------------------

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    pytest.importorskip("triton")
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    with use_backend("triton"):
        yield


def _dev(x: dict) -> dict:
    return {n: v.to(DEVICE) for n, v in x.items()}


def _to_cpu(r: dict) -> dict:
    return {n: ([f.cpu() for f in v] if isinstance(v, list) else v.cpu()) for n, v in r.items()}


@pytest.mark.parametrize(("name", "value"), [("v", NAN), ("k", INF), ("q", NAN)],
                         ids=lambda x: str(x))
def test_triton_kernels_documents(triton_backend: None, name: str, value: float) -> None:
    x = _dev(_inputs())
    ref = _to_cpu(_run("la", x, CU))
    got = _to_cpu(_run("la", _poisoned(x, name, 30, value), CU))
    bad = _check(got, ref, CU, 1, 30)
    assert not bad, bad


def test_triton_kernels_hard_reset_and_decay(triton_backend: None) -> None:
    from hla_sp.ops.primitive import chunk_linear_attention_triton

    x = _dev(_inputs())
    x["g"][0, 40] = -INF
    ref = _to_cpu(_run("la", x, None))
    got = _to_cpu(_run("la", _poisoned(x, "v", 30, NAN), None))
    for n in ("o", "dq", "dk", "dv", "dg"):
        assert _same(got[n][:, 40:], ref[n][:, 40:]), n
    assert _same(got["o"][:, :30], ref["o"][:, :30])
    # a NaN decay, which only the layers below the public calls can pass
    resets = torch.zeros(1, T, dtype=torch.bool, device=DEVICE)
    resets[0, [24, 40]] = True

    def call(q, k, v, *, log_decay, cu_seqlens, output_final_state, chunk_size):
        o, _ = chunk_linear_attention_triton(q, k, v, log_decay, resets=resets,
                                             chunk_size=chunk_size)
        return o, None  # the last document's state only: not per document

    x = _dev(_inputs())
    ref = _to_cpu(_run("la", x, None, fn=call))
    got = _to_cpu(_run("la", _poisoned(x, "g", 30, NAN, whole=True), None, fn=call))
    bad = _check(got, ref, CU, 1, 30)
    assert not bad, bad


@pytest.mark.parametrize("mode", ["chunked", "sequential"])
def test_fused_hla2_documents(triton_backend: None, mode: str) -> None:
    """Both forward kernels; the backward (the same kernels for both modes) once."""
    from hla_sp.ops import hla2_fused

    kw = dict(fn=hla2_fused, mode=mode, backward=mode == "chunked")
    x = _dev(_inputs())
    ref = _to_cpu(_run("hla2", x, CU, final=False, **kw))
    got = _to_cpu(_run("hla2", _poisoned(x, "v", 30, NAN), CU, final=False, **kw))
    bad = _check(got, ref, CU, 1, 30)
    assert not bad, bad
    x["g"][0, 40] = -INF  # a hard reset, and the fused path's own final states
    ref = _to_cpu(_run("hla2", x, None, **kw))
    got = _to_cpu(_run("hla2", _poisoned(x, "k", 30, INF), None, **kw))
    for n in ("o", "dq", "dk", "dv", "dg"):
        assert _same(got[n][:, 40:], ref[n][:, 40:]), n
    assert _same(got["o"][:, :30], ref["o"][:, :30])
    for f, fr in zip(got["finals"], ref["finals"]):
        assert _same(f, fr)


# Sequence parallelism --------------------------------------------------------------------

SP_KINDS = [("v", NAN, 30), ("k", INF, 34), ("q", NAN, 26)]  # on rank 0 or 1 (contiguous)


def sp_isolation_task(rank: int, P: int, composed: bool) -> list[str]:
    """World task: every method x layout, la and hla2, poisoned vs clean, on this shard."""
    from hla_sp.parallel import SequenceParallel, positions, primitive, shard, split_lengths

    real = primitive._use_split
    if composed:
        primitive._use_split = lambda q: False
    errors = []
    try:
        with use_backend("torch"):
            for method, layout, op in itertools.product(
                    SP_METHODS, ("contiguous", "zigzag"), ("la", "hla2")):
                sp = SequenceParallel(layout=layout, method=method)
                lengths = split_lengths(T, P, layout)
                pos = positions(rank, P, layout, lengths)

                def run(x: dict, layout=layout, lengths=lengths, op=op, sp=sp) -> dict:
                    xs = {n: shard(v, rank, P, layout, lengths=lengths) for n, v in x.items()}
                    return _run(op, xs, CU, sp=sp)

                x = _inputs(seed=3)
                ref = run(x)
                for name, value, t in SP_KINDS:
                    got = run(_poisoned(x, name, t, value))
                    for d, (s, e) in enumerate(itertools.pairwise(CU)):
                        lo, hi = (s, e) if d != 1 else (s, t)
                        mine = ((pos >= lo) & (pos < hi)).nonzero().flatten()
                        names = ["o"] if d == 1 else ["o", "dq", "dk", "dv", "dg"]
                        for n in names:
                            if not _same(got[n][:, mine], ref[n][:, mine]):
                                errors.append(f"rank {rank} {method} {layout} {op} {name}={value}"
                                              f" at {t}: {n} of document {d}")
                        if d != 1:
                            for i, (f, fr) in enumerate(zip(got["finals"], ref["finals"])):
                                if not _same(f[d], fr[d]):
                                    errors.append(f"rank {rank} {method} {layout} {op} "
                                                  f"{name}={value}: final {i} of document {d}")
    finally:
        primitive._use_split = real
    return errors


@pytest.mark.timeout(600)
@pytest.mark.parametrize("composed", [False, True], ids=["split", "composed"])
def test_sequence_parallel_documents(world, composed: bool) -> None:
    errors = world(2).run(sp_isolation_task, composed, timeout=560)
    flat = [e for rank_errors in errors for e in rank_errors]
    assert not flat, "\n".join(flat[:20])


# The short convolution and the layer ------------------------------------------------------


def _layer(short_conv: int = 4):
    from hla_sp.nn import HLAttention

    torch.manual_seed(0)
    return HLAttention(32, 2, 16, operator="hla2", decay="learned", chunk_size=16,
                       short_conv=short_conv)


def test_short_conv_documents() -> None:
    from hla_sp.nn.conv import ShortConv

    conv = ShortConv([("x", 8, 8, 0)], 4)
    x = torch.randn(1, T, 8)
    state = torch.randn(3, 3, 8)
    bad_state = state.clone()
    bad_state[1] = NAN
    for poisoned, st in [((30, NAN), state), ((26, INF), state), (None, bad_state)]:
        xr = x.clone().requires_grad_(True)
        yr, fr = conv(xr, bounds=CU, state=state, want_final=True)
        (yr.sum() + fr.sum()).backward()
        xp = x.clone()
        if poisoned is not None:
            xp[0, poisoned[0], 3] = poisoned[1]
        xp.requires_grad_(True)
        yp, fp = conv(xp, bounds=CU, state=st, want_final=True)
        (yp.sum() + fp.sum()).backward()
        t = 24 if poisoned is None else poisoned[0]
        for d, (s, e) in enumerate(itertools.pairwise(CU)):
            if d == 1:
                assert _same(yp[:, s:t], yr[:, s:t])
                continue
            assert _same(yp[:, s:e], yr[:, s:e]), d
            assert _same(xp.grad[:, s:e], xr.grad[:, s:e]), d
            assert _same(fp[d], fr[d]), d


def test_layer_documents(torch_backend: None) -> None:
    m = _layer()
    x = torch.randn(1, T, 32)
    cu = torch.tensor(CU)
    outs = []
    for value in (None, NAN):
        xx = x.clone()
        if value is not None:
            xx[0, 30, 5] = value
        xx.requires_grad_(True)
        y, _ = m(xx, cu_seqlens=cu, output_final_state=True)
        y.sum().backward()
        outs.append((y.detach(), xx.grad))
    for d, (s, e) in enumerate(itertools.pairwise(CU)):
        hi = 30 if d == 1 else e
        assert _same(outs[1][0][:, s:hi], outs[0][0][:, s:hi]), d
        if d != 1:
            assert _same(outs[1][1][:, s:e], outs[0][1][:, s:e]), d


def sp_conv_task(rank: int, P: int) -> list[str]:
    """World task: the layer (short conv with its halo, then hla2) under both layouts."""
    from hla_sp.parallel import SequenceParallel, positions, shard, split_lengths

    errors = []
    with use_backend("torch"):
        for layout in ("contiguous", "zigzag"):
            m = _layer()
            sp = SequenceParallel(layout=layout)
            lengths = split_lengths(T, P, layout)
            pos = positions(rank, P, layout, lengths)
            x = torch.randn(1, T, 32, generator=torch.Generator().manual_seed(1))
            res = []
            for value in (None, NAN):
                xx = x.clone()
                if value is not None:
                    xx[0, 30, 5] = value
                xs = shard(xx, rank, P, layout, lengths=lengths).requires_grad_(True)
                y, st = m(xs, cu_seqlens=torch.tensor(CU), sp=sp, output_final_state=True)
                y.sum().backward()
                res.append((y.detach(), xs.grad, st.conv.detach()))
            for d, (s, e) in enumerate(itertools.pairwise(CU)):
                hi = 30 if d == 1 else e
                mine = ((pos >= s) & (pos < hi)).nonzero().flatten()
                if not _same(res[1][0][:, mine], res[0][0][:, mine]):
                    errors.append(f"rank {rank} {layout}: y of document {d}")
                if d != 1 and not _same(res[1][1][:, mine], res[0][1][:, mine]):
                    errors.append(f"rank {rank} {layout}: dx of document {d}")
                if d != 1 and not _same(res[1][2][d], res[0][2][d]):
                    errors.append(f"rank {rank} {layout}: conv state of document {d}")
    return errors


@pytest.mark.timeout(300)
def test_sequence_parallel_layer_with_conv(world) -> None:
    errors = world(2).run(sp_conv_task, timeout=280)
    flat = [e for rank_errors in errors for e in rank_errors]
    assert not flat, "\n".join(flat[:20])


# Meta and fake tensors, the group check, empty shards ----------------------------------


@pytest.mark.parametrize("op", list(OPS))
def test_operators_on_meta_tensors(op: str) -> None:
    q = torch.empty(1, T, H, K, device="meta")
    v = torch.empty(1, T, H, V, device="meta")
    g = torch.empty(1, T, H, device="meta")
    o, st = OPS[op](q, q, v, log_decay=g, cu_seqlens=torch.tensor(CU),
                    output_final_state=True)
    assert o.shape == (1, T, H, V) and o.device.type == "meta"
    assert st is not None


def test_layer_on_meta_and_fake_tensors_and_flop_counter() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from hla_sp.nn import HLAttention

    with torch.device("meta"):
        m = HLAttention(32, 2, 16, operator="hla2", decay="learned", chunk_size=16,
                        short_conv=4)
        x = torch.empty(1, T, 32, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        y, _ = m(x, cu_seqlens=torch.tensor(CU))
        y.sum().backward()
    assert y.shape == (1, T, 32) and y.device.type == "meta"
    assert counter.get_total_flops() > 0
    with FakeTensorMode() as mode:
        mf = HLAttention(32, 2, 16, operator="ahla", decay="data", chunk_size=16)
        xf = mode.from_tensor(torch.randn(2, T, 32))
        yf, _ = mf(xf)
        assert yf.shape == (2, T, 32)


def outside_group_task(rank: int, P: int) -> str:
    import torch.distributed as dist

    from hla_sp.parallel import SequenceParallel

    group = dist.new_group([0])  # every rank takes part in creating it
    if rank == 0:
        return ""
    q = torch.randn(1, 8, 1, 4)
    try:
        hla_sp.linear_attention(q, q, q, sp=SequenceParallel(group=group))
    except Exception as e:  # the message is what is checked
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_outside_the_group_is_named(world) -> None:
    msg = world(2).run(outside_group_task, timeout=60)[1]
    assert "TypeError" not in msg, msg
    assert "group" in msg and "global rank 1" in msg and "not in the group" in msg, msg


def empty_shard_task(rank: int, P: int) -> list[str]:
    from hla_sp.parallel import SequenceParallel, shard

    lengths = [0, 16]
    sp = SequenceParallel()
    x = _inputs(T=16)
    leaves = {n: shard(x[n], rank, P, "contiguous", lengths=lengths).requires_grad_(True)
              for n in ("q", "k", "v", "g")}
    o, _ = hla_sp.hla2(leaves["q"], leaves["k"], leaves["v"], log_decay=leaves["g"], sp=sp,
                       cu_seqlens=torch.tensor([0, 16]))
    (o * 1.0).sum().backward()
    bad = []
    for n, t in leaves.items():
        if t.grad is None:
            bad.append(f"rank {rank}: {n}.grad is None")
        elif t.grad.shape != t.shape:
            bad.append(f"rank {rank}: {n}.grad shape {tuple(t.grad.shape)}")
    return bad


def test_empty_shard_gives_empty_gradients(world) -> None:
    errors = world(2).run(empty_shard_task, timeout=60)
    flat = [e for rank_errors in errors for e in rank_errors]
    assert not flat, flat
    assert math.isfinite(0.0)

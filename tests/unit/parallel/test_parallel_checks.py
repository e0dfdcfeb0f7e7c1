"""Sequence parallelism: argument checks, cross-rank agreement, traffic, call chains.

- a mismatch across ranks (shapes, dtype, documents, lengths, layout, method,
  operator) raises the same ValueError on every rank, and the task finishes within
  its timeout (``World.run`` raises ``WorldTimeout`` on a hang);
- bytes sent per rank do not depend on T, and summaries travel in fp32 for bf16;
- several sharded calls in a row (layers) with an empty shard backpropagate exactly.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

import hla_sp
from hla_sp.config import SP_METHODS
from hla_sp.parallel import SequenceParallel, reset_traffic, shard, traffic
from hla_sp.testing import RemoteError, World


def _inputs(T: int, B: int = 1, H: int = 2, K: int = 4, V: int = 3, dtype=torch.float32,
            seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, T, H, d, generator=gen).to(dtype) for d in (K, K, V))


# --------------------------------------------------------------------- local checks


def test_sequence_parallel_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="layout: expected one of"):
        SequenceParallel(layout="striped")
    with pytest.raises(ValueError, match="method: expected one of"):
        SequenceParallel(method="alltoall")
    with pytest.raises(ValueError, match="check_timeout_s: expected a number > 0"):
        SequenceParallel(check_timeout_s=0)
    with pytest.raises(TypeError, match=r"group: expected a torch\.distributed\.ProcessGroup"):
        SequenceParallel(group="world")  # type: ignore[arg-type]
    assert hla_sp.SequenceParallel is SequenceParallel


def test_needs_an_initialized_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    q, k, v = _inputs(8)
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialized"):
        hla_sp.linear_attention(q, k, v, sp=SequenceParallel())


# ------------------------------------------------------------- cross-rank agreement


def _mismatch_task(rank: int, P: int) -> list[str]:
    """Each scenario breaks agreement on one rank; return what every rank raised."""
    T = 8 * P
    seen = []

    def attempt(name, fn):
        try:
            fn()
            seen.append(f"{name}: no error")
        except ValueError as e:
            seen.append(f"{name}: {e}")

    q, k, v = _inputs(T // P)
    sp = SequenceParallel()
    K2 = 5 if rank == P - 1 else 4
    qK, kK, _ = _inputs(T // P, K=K2)
    attempt("K", lambda: hla_sp.linear_attention(qK, kK, v, sp=sp))
    dt = torch.float64 if rank == 0 else torch.float32
    attempt("dtype", lambda: hla_sp.hla2(q.to(dt), k.to(dt), v.to(dt), sp=sp))
    cu = torch.tensor([0, 3 + (rank == 1), T])
    attempt("cu_seqlens", lambda: hla_sp.ahla(q, k, v, cu_seqlens=cu, sp=sp))
    cu_bad = torch.tensor([0, 3, T + 1])
    attempt("total", lambda: hla_sp.linear_attention(q, k, v, cu_seqlens=cu_bad, sp=sp))
    sp_m = SequenceParallel(method="ring" if rank == 0 else "allgather")
    attempt("method", lambda: hla_sp.linear_attention(q, k, v, sp=sp_m))
    op = hla_sp.hla3 if rank == P - 1 else hla_sp.ahla
    attempt("op", lambda: op(q, k, v, sp=sp))
    attempt("options", lambda: hla_sp.hla2(q, k, v, normalize=rank == 0, sp=sp))
    attempt("final", lambda: hla_sp.linear_attention(q, k, v, output_final_state=rank == 0,
                                                     sp=sp))
    qz, kz, vz = _inputs(2 * (4 + (rank == 0)))
    attempt("zigzag", lambda: hla_sp.linear_attention(qz, kz, vz, sp=SequenceParallel(
        layout="zigzag")))
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [2, 3])
def test_mismatch_raises_on_every_rank(world, P: int) -> None:
    per_rank = world(P).run(_mismatch_task, timeout=60)  # WorldTimeout on a hang
    expect = {
        "K": "K differs across ranks: 4 on ranks",
        "dtype": "dtype differs across ranks: torch.float64 on ranks [0]",
        "cu_seqlens": "cu_seqlens differs across ranks: [0, 3, ",
        "total": "cu_seqlens[-1] = ",
        "method": "method differs across ranks: 'ring' on ranks [0]",
        "op": "operator differs across ranks: 'ahla' on ranks [0",
        "options": "normalize differs across ranks: True on ranks [0], False on ranks [1",
        "final": "output_final_state differs across ranks: True on ranks [0], False on ranks [1",
        "zigzag": "zigzag layout needs the same even local T",
    }
    for rank, seen in enumerate(per_rank):
        assert len(seen) == len(expect)
        for line, (name, text) in zip(seen, expect.items()):
            assert line.startswith(f"{name}: "), (rank, line)
            assert text in line, (rank, line)
        # Every rank raised the same message.
        assert seen == per_rank[0]


def _replicated_mismatch_task(rank: int, P: int) -> list[str]:
    """Values every rank must share (scale, initial state, per-head decay, options):
    one rank differs in each scenario; return what every rank raised (or computed)."""
    T = 8 * P
    q, k, v = _inputs(T // P)
    sp = SequenceParallel(check_timeout_s=30.0)
    gen = torch.Generator().manual_seed(7)
    h0 = torch.randn(1, 2, 4, 3, generator=gen)
    S0 = torch.randn(1, 2, 4, 4, generator=gen)
    S0 = S0 + S0.transpose(-1, -2)
    H0 = torch.randn(1, 2, 4, 3, generator=gen)
    g = torch.full((2,), -0.1)
    seen = []

    def attempt(name, fn):
        start = time.monotonic()
        try:
            fn()
            seen.append(f"{name}: no error")
        except ValueError as e:
            seen.append(f"{name}: {e}")
        assert time.monotonic() - start < 20, name  # within seconds, not a timeout

    one = rank == 1
    attempt("scale", lambda: hla_sp.hla2(q, k, v, scale=1.0 if one else 0.5, sp=sp))
    attempt("scale_la", lambda: hla_sp.linear_attention(q, k, v, scale=1.0 if one else 0.5,
                                                        sp=sp))
    attempt("h0_one_rank", lambda: hla_sp.linear_attention(
        q, k, v, initial_state=h0 if rank == 0 else None, sp=sp))
    attempt("h0_values", lambda: hla_sp.linear_attention(
        q, k, v, initial_state=h0 + one, sp=sp))
    attempt("state_values", lambda: hla_sp.hla2(
        q, k, v, initial_state=(S0, H0 * (2.0 if one else 1.0)), sp=sp))
    attempt("state_one_rank", lambda: hla_sp.hla3(
        q, k, v, initial_state=None if one else (S0, torch.zeros(1, 2, 4, 3), H0), sp=sp))
    attempt("decay_given", lambda: hla_sp.ahla(q, k, v, log_decay=None if one else g, sp=sp))
    attempt("decay_kind", lambda: hla_sp.hla2(
        q, k, v, log_decay=torch.full((1, T // P, 2), -0.1) if one else g, sp=sp))
    attempt("decay_values", lambda: hla_sp.hla2(q, k, v, log_decay=g * (1 + one), sp=sp))
    attempt("ridge", lambda: hla_sp.hla2(q, k, v, ridge=0.25 if one else 0.0, sp=sp))
    attempt("eps", lambda: hla_sp.hla2(q, k, v, normalize=True, eps=1e-3 if one else 1e-6,
                                       sp=sp))
    from hla_sp.ops import run_operator

    qg = torch.cat([q, q], dim=2)  # 4 query heads over 2 kv heads
    mix = torch.full((4,), 0.5 + one)
    attempt("key_mix", lambda: run_operator("hla2", qg, k, v, key_mix=mix, sp=sp))
    # Agreeing ranks still run, with a per-token decay and an initial state: no error.
    attempt("agree", lambda: hla_sp.hla2(q, k, v, log_decay=torch.full((1, T // P, 2), -0.1),
                                         initial_state=(S0, H0), sp=sp))
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [2, 3])
def test_replicated_values_must_agree(world, P: int) -> None:
    per_rank = world(P).run(_replicated_mismatch_task, timeout=90)
    rest = "[0]" if P == 2 else "[0, 2]"
    expect = {
        "scale": f"scale differs across ranks: 0.5 on ranks {rest}, 1.0 on ranks [1]",
        "scale_la": f"scale differs across ranks: 0.5 on ranks {rest}, 1.0 on ranks [1]",
        "h0_one_rank": "initial_state differs across ranks: given with values digest ",
        "h0_values": "initial_state differs across ranks: given with values digest ",
        "state_values": "initial_state differs across ranks: given with values digest ",
        "state_one_rank": "initial_state differs across ranks: given with values digest ",
        "decay_given": f"log_decay differs across ranks: per-head constant on ranks {rest}, "
                       "None on ranks [1]",
        "decay_kind": f"log_decay differs across ranks: per-head constant on ranks {rest}, "
                      "per token on ranks [1]",
        "decay_values": "log_decay values differs across ranks: digest ",
        "ridge": f"ridge differs across ranks: 0.0 on ranks {rest}, 0.25 on ranks [1]",
        "eps": f"eps differs across ranks: 1e-06 on ranks {rest}, 0.001 on ranks [1]",
        "key_mix": "key_mix differs across ranks: given with values digest ",
        "agree": "agree: no error",
    }
    for rank, seen in enumerate(per_rank):
        assert len(seen) == len(expect)
        for line, (name, text) in zip(seen, expect.items()):
            assert line.startswith(f"{name}: "), (rank, line)
            assert text in line, (rank, line)
        assert seen == per_rank[0]  # every rank raised the same message
    lines = dict(zip(expect, per_rank[0]))
    assert "None on ranks [1" in lines["h0_one_rank"]
    assert "None on ranks [1]" in lines["state_one_rank"]
    # Only the differing option is named.
    for name in ("ridge", "eps", "scale"):
        assert lines[name].count("differs") == 1, lines[name]


def _direct_primitive_task(rank: int, P: int) -> str:
    from hla_sp.ops.primitive import primitive

    q, k, v = _inputs(4)
    try:
        primitive(q, k, v, None, sp=SequenceParallel())
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(60)
def test_primitive_without_checked_call_raises(world) -> None:
    for msg in world(2).run(_direct_primitive_task, timeout=30):
        assert "no checked call matches this shard" in msg


# ------------------------------------------------------------------------- traffic


def _traffic_task(rank: int, P: int, T: int, dtype: torch.dtype) -> dict[str, dict[str, int]]:
    out = {}
    for layout in ("contiguous", "zigzag"):
        for method in SP_METHODS:
            sp = SequenceParallel(layout=layout, method=method)
            q, k, v = (shard(x, rank, P, layout).requires_grad_(True)
                       for x in _inputs(T, dtype=dtype))
            reset_traffic()
            o, st = hla_sp.hla2(q, k, v, log_decay=torch.full((2,), -0.1), sp=sp,
                                output_final_state=True)
            (o.float().square().sum() + st.H.sum()).backward()
            out[f"{layout}/{method}"] = traffic()
    return out


@pytest.mark.timeout(120)
def test_bytes_per_rank_do_not_grow_with_T(world) -> None:
    P = 4
    w = world(P)
    small = w.run(_traffic_task, 32, torch.float32, timeout=60)
    large = w.run(_traffic_task, 8 * 32, torch.float32, timeout=60)
    bf16 = w.run(_traffic_task, 32, torch.bfloat16, timeout=60)
    for rank in range(P):
        assert small[rank] == large[rank], rank
        # Summaries and states cross ranks in fp32 whatever the input dtype.
        assert bf16[rank] == small[rank], rank
    for name in small[0]:
        for kind in ("summary", "summary_grad", "final", "final_grad"):
            # Some ranks send nothing in one direction (ring: the last rank forward).
            assert sum(small[r][name].get(kind, 0) for r in range(P)) > 0, (name, kind)
    # allgather: each rank sends its fp32 summaries to P - 1 ranks, once per stage.
    H, K, V = 2, 4, 3
    D1, D2 = H * K * K + H + 1, H * K * V + H + 1
    assert small[0]["contiguous/allgather"]["summary"] == (P - 1) * 4 * (D1 + D2)
    assert small[0]["zigzag/allgather"]["summary"] == (P - 1) * 4 * 2 * (D1 + D2)


# ------------------------------------------------------------------ chained calls


def _chain(q, k, v, g, sp, cu):
    o1, _ = hla_sp.hla2(q, k, v, log_decay=g, sp=sp, cu_seqlens=cu)
    o2, _ = hla_sp.ahla(o1[..., :4] * 0.5, k, o1, log_decay=g, sp=sp, cu_seqlens=cu)
    o3, st = hla_sp.linear_attention(q, o2[..., :4] + k, v, sp=sp, cu_seqlens=cu,
                                     output_final_state=True)
    return o3, st


def _chain_task(rank: int, P: int, method: str) -> float:
    T = 20
    lengths = [7, 0, 13] if P == 3 else None
    q, k, v = (x.double() for x in _inputs(T, H=2, K=4, V=4, seed=3))
    g = -torch.rand(2, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    cu = torch.tensor([0, 7, 11, T])
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    o, st = _chain(*leaves, g, None, cu)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=o.dtype)
    ((o * w).sum() + st.sum()).backward()
    ref = [x.grad for x in leaves]
    mine = [shard(x, rank, P, lengths=lengths).requires_grad_(True) for x in (q, k, v)]
    o_sp, st_sp = _chain(*mine, g, SequenceParallel(method=method), cu)
    ((o_sp * shard(w, rank, P, lengths=lengths)).sum() + st_sp.sum() / P).backward()
    o_ref = shard(o.detach(), rank, P, lengths=lengths)
    pairs = [(st_sp.detach(), st.detach()), (o_sp.detach(), o_ref)]
    for a, b in zip(mine, ref):
        pairs.append((a.grad if a.grad is not None else torch.zeros_like(a),
                      shard(b, rank, P, lengths=lengths)))
    # Relative to each reference's own size: the chain's values grow to ~1e10.
    return max(float((a - b).abs().amax() / b.abs().amax()) if a.numel() else 0.0
               for a, b in pairs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", SP_METHODS)
def test_chained_calls_with_an_empty_shard(world, method: str) -> None:
    errs = world(3).run(_chain_task, method, timeout=90)
    assert max(errs) < 1e-10, errs


def _local_error_task(rank: int, P: int) -> None:
    q, k, v = _inputs(4)
    sp = SequenceParallel(check_timeout_s=3.0)
    hla_sp.linear_attention(q[..., :3] if rank == 1 else q, k, v, sp=sp)


@pytest.mark.timeout(120)
def test_a_rank_failing_its_own_checks_does_not_hang_the_others() -> None:
    # Its own world: the timed-out collective leaves the group unusable.
    with World(2) as w, pytest.raises(RemoteError) as info:
        w.run(_local_error_task, timeout=60)
    errors = info.value.errors
    assert sorted(errors) == [0, 1]
    assert "k: expected shape" in errors[1][1]
    assert "not every rank of the group joined the agreement check" in errors[0][1]


def _crashing_peer(rank: int, init_file: str, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=2)
    dist.barrier()
    if rank == 1:
        time.sleep(0.5)
        os._exit(3)  # a crash: no error raised, no clean shutdown
    q, k, v = _inputs(4)
    start = time.monotonic()
    try:
        hla_sp.linear_attention(q, k, v, sp=SequenceParallel(check_timeout_s=60.0))
        out.put(("no error", time.monotonic() - start))
    except RuntimeError as e:
        out.put((str(e), time.monotonic() - start))
    out.close()
    out.join_thread()  # flush the queue's feeder thread before the hard exit
    os._exit(0)  # the group is broken: skip its teardown


@pytest.mark.timeout(120)
def test_a_crashed_peer_is_reported_first_with_the_real_elapsed_time() -> None:
    """A peer that dies makes the survivors raise at once: the message leads with the
    real cause and the time actually waited, not "within 600.0 s"."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="hla_sp_crash_") as d:
        out = ctx.Queue()
        procs = [ctx.Process(target=_crashing_peer, args=(r, os.path.join(d, "rdv"), out),
                             daemon=True) for r in range(2)]
        for p in procs:
            p.start()
        try:
            msg, elapsed = out.get(timeout=90)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    assert procs[1].exitcode == 3
    assert elapsed < 30, (elapsed, msg)
    assert msg.startswith("SequenceParallel: the agreement check of this linear "
                          "call failed after "), msg
    shown = float(msg.split("failed after ")[1].split(" s:")[0])
    assert abs(shown - elapsed) < 1.0, (shown, elapsed, msg)
    assert "60.0" not in msg and "within" not in msg, msg
    cause = msg.split(" s: ", 1)[1]
    assert cause.startswith("Connection closed by peer"), msg


def _summary_with_subtraction(k, v, g):
    """The weights exp(A_L - A_j) from prefix sums, by subtraction (the old bug)."""
    A = g.cumsum(1)
    w = torch.exp(A[:, -1:] - A)
    return torch.einsum("blhk,blhv->bhkv", k * w[..., None], v), A[:, -1]


def _check_summary(fn, k, v, g) -> None:
    """A segment's summary in fp32 within its rounding bound, elementwise.

    h = sum_j exp(s_j) k_j v_j^T with s_j = sum_{i>j} g_i. Term j passes through the
    casts of k and v, one product in k * w, the exp, the products of the dot, and
    L - 1 additions over j (any order: (L - 1) u of the sum of magnitudes); the
    exponent s_j, a prefix sum of the L - 1 - j reversed log-decays in any order and
    blocking, errs by at most (L - 1 - j) u |s_j|, which is the weight's relative
    error. So |h32 - h| <= u * sum_j w_j |k_j| |v_j| (L + 6 + (L - 1 - j) |s_j|)."""
    from hla_sp.testing import assert_within_rounding

    L = k.shape[1]
    s = g.flip(1).cumsum(1).flip(1)
    s = torch.nn.functional.pad(s[:, 1:], (0, 0, 0, 1))  # sum_{i > j} g_i (fp64)
    n_exp = torch.arange(L - 1, -1, -1, dtype=torch.float64)[None, :, None]
    w = torch.exp(s) * (L + 6 + n_exp * s.abs())
    mag_h = torch.einsum("blhk,blhv->bhkv", k.abs() * w[..., None], v.abs())
    h32, a32 = fn(k.float(), v.float(), g.float())
    assert_within_rounding("h", h32, segment_summary_64(k, v, g)[0], mag_h,
                           {torch.float32: 1})
    # A_L: L - 1 additions and the casts of the log-decays.
    assert_within_rounding("a", a32, g.sum(1), g.abs().sum(1), {torch.float32: L + 1})


def segment_summary_64(k, v, g):
    from hla_sp.ops.chunk import segment_summary

    return segment_summary(k, v, g)


def test_long_shard_summary_is_accurate_in_fp32(num_threads: int) -> None:
    """A rank's summary spans its whole shard, whose total log-decay A_L can be ~-1e4
    while the last tokens decay slowly. exp(A_L - A_j) computed by subtraction of
    prefix sums loses u |A_L| ~ 6e-4 in every weight's exponent; the summary's
    weights, exps of suffix sums, stay within the rounding bound (checked to fail
    for the subtraction)."""
    from hla_sp.ops.chunk import segment_summary

    gen = torch.Generator().manual_seed(0)
    L, H, K = 512, 2, 8
    k, v = (torch.randn(1, L, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    g = -0.03 * (1 + torch.rand(1, L, H, generator=gen, dtype=torch.float64))
    g[:, : L // 2] = -1e4 / (L // 2)  # A_L ~ -1e4 reached early
    _check_summary(segment_summary, k, v, g)
    with pytest.raises(AssertionError, match="exceeds the rounding bound"):
        _check_summary(_summary_with_subtraction, k, v, g)


def _plan_is_freed(rank: int, world_size: int, use_checkpoint: bool) -> bool:
    import gc
    import weakref

    from torch.utils.checkpoint import checkpoint

    sp = SequenceParallel()
    q = torch.randn(1, 40, 2, 8, requires_grad=True)
    plans = []  # weak references to the plans check_call returned
    check = sp.check_call

    def spy(*args: object, **kwargs: object) -> object:
        plan = check(*args, **kwargs)
        plans.append(weakref.ref(plan))
        return plan

    sp.check_call = spy  # type: ignore[method-assign]

    def layer(x: torch.Tensor) -> torch.Tensor:
        return hla_sp.hla2(x, x, x, sp=sp)[0]

    o = checkpoint(layer, q, use_reentrant=False) if use_checkpoint else layer(q)
    o.sum().backward()
    del o
    gc.collect()
    return bool(plans) and all(p() is None for p in plans)


@pytest.mark.parametrize("use_checkpoint", [False, True], ids=["plain", "checkpoint"])
def test_a_call_leaves_nothing_alive_after_backward(world, use_checkpoint: bool) -> None:
    """An autograd context that kept the plan (and so its token's grad_fn) closed a
    cycle through autograd nodes: each call's graph leaked (~0.25 GiB per step at
    CP=2 under non-reentrant checkpointing)."""
    assert all(world(2).run(_plan_is_freed, use_checkpoint, timeout=120))

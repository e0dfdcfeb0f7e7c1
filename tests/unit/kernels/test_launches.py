"""Kernel launches of one ``linear_attention`` forward and backward on the Triton path.

Counted with the launch capture of ``hla_sp.kernels._jit`` (the one the ahead-of-time
gate uses): launches are described, not run, so the count is exact and needs no GPU.
The primitive's forward is a state pass, an output kernel and the gated poison; its
backward recomputes the states, runs their gradients in reverse, then dv and
dq/dk/dg and the gated poison: eight launches, with or without a decay, documents or
states (no serial decay-gradient pass, no separate chunk-state kernel, no flag pass);
hla2, two passes of the primitive, sixteen. Under ``capture(every=True)`` every tuning
candidate of a launch is described as well, which is what the gate compiles.

The whole step's launches, PyTorch's included, are counted from the profiler's
operator events (:func:`_all_launches`).
"""

from __future__ import annotations

import pytest
import torch

import hla_sp

STEP = ["chunk_fwd_h_kernel", "chunk_fwd_o_kernel", "poison_fwd_kernel", "chunk_fwd_h_kernel",
        "chunk_bwd_dh_kernel", "chunk_bwd_dv_kernel", "chunk_bwd_dqk_kernel",
        "poison_bwd_kernel"]
UNTUNED = {"poison_fwd_kernel", "poison_bwd_kernel"}


@pytest.fixture
def triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HLA_SP_BACKEND", "triton")


def _jobs(dtype: torch.dtype, docs: bool, every: bool = False, op: str = "linear_attention",
          D: int = 32) -> list[dict]:
    """The launches one forward and backward describes, in order."""
    from hla_sp.kernels import _jit

    device = "cuda" if torch.cuda.is_available() else "cpu"
    T, H = 40, 2

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device).to(dtype).requires_grad_()

    q, k, v = leaf(1, T, H, D), leaf(1, T, H, D), leaf(1, T, H, D)
    g = (-0.1 * torch.rand(1, T, H, device=device)).requires_grad_()
    kw: dict = dict(log_decay=g)
    if docs:
        kw.update(cu_seqlens=torch.tensor([0, 13, T], device=device),
                  initial_state=leaf(2, H, D, D), output_final_state=True)
    with _jit.capture(every=every) as launched:
        o, _ = getattr(hla_sp, op)(q, k, v, **kw)
        o.float().sum().backward()
    return launched


def _step(dtype: torch.dtype, docs: bool, every: bool = False, op: str = "linear_attention"
          ) -> list[str]:
    """The kernels one forward and backward launches, in order."""
    return [job["kernel"] for job in _jobs(dtype, docs, every, op)]


@pytest.mark.parametrize("docs", [False, True], ids=["plain", "docs-states"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_eight_launches_per_step(triton_path: None, dtype: torch.dtype, docs: bool) -> None:
    assert _step(dtype, docs) == STEP


def test_hla2_is_two_primitive_steps(triton_path: None) -> None:
    """hla2 runs the primitive twice (k~ = LA(q, k, k), then LA(q, k~, v)), forward and
    backward: sixteen launches, the same eight kernels twice."""
    launched = _step(torch.bfloat16, docs=False, op="hla2")
    assert len(launched) == 16 and sorted(launched) == sorted(STEP + STEP)


def test_capture_every_candidate(triton_path: None) -> None:
    """The gate's capture describes each tuning candidate once per launch (bf16 at
    K = V = 32: the 64- and 128-wide candidates resolve to one 32-wide tile, so the
    distinct ones are those differing in warps or tiles)."""
    from hla_sp.kernels._tiles import candidates

    every = _step(torch.bfloat16, docs=False, every=True)
    roles = {"chunk_fwd_h_kernel": "state", "chunk_bwd_dh_kernel": "state",
             "chunk_fwd_o_kernel": "out", "chunk_bwd_dv_kernel": "out",
             "chunk_bwd_dqk_kernel": "dqk"}
    want = sum(1 if name in UNTUNED else len(candidates(roles[name], torch.bfloat16, 32, 32))
               for name in STEP)
    assert len(every) == want > len(STEP)
    assert set(every) == set(STEP)


def test_sm90_candidates_only_there(triton_path: None) -> None:
    """Candidates that spill over the limit on sm_80 (wider tiles) are tuned on sm_90
    only: a GPU of another capability never times them, and the gate's capture tags
    their launches so that it compiles them for sm_90a alone."""
    from hla_sp.kernels._tiles import SM90, candidates

    for role in ("out", "dqk"):
        mine = [c for c in candidates(role, torch.bfloat16, 128, 128) if c.archs]
        assert mine and all(c.archs == SM90 for c in mine)
        assert not any(c.archs for c in candidates(role, torch.bfloat16, 128, 128, arch=80))
        assert set(mine) <= set(candidates(role, torch.bfloat16, 128, 128, arch=90))
    jobs = _jobs(torch.bfloat16, docs=False, every=True, D=128)
    tagged = {(j["kernel"], j["constexprs"]["BK"], j["constexprs"]["BV"]) for j in jobs
              if j.get("archs") == [90]}
    assert tagged == {("chunk_fwd_o_kernel", 128, 64), ("chunk_bwd_dv_kernel", 128, 64),
                      ("chunk_bwd_dqk_kernel", 64, 64)}
    # the default launches (capture without every) carry no tag
    assert not any("archs" in j for j in _jobs(torch.bfloat16, docs=False, D=128))


# PyTorch operators that launch no kernel: views, allocations, metadata, and the host
# read of a CPU scalar (on a GPU the decay's value check runs on the device instead,
# as max, le and _assert_async, which this count then includes).
NO_LAUNCH = frozenset(f"aten::{n}" for n in (
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view",
    "_unsafe_view", "_reshape_alias", "reshape", "as_strided", "transpose", "t", "permute",
    "expand", "expand_as", "broadcast_to", "unsqueeze", "squeeze", "unflatten", "slice",
    "select", "narrow", "detach", "alias", "lift_fresh", "resize_", "contiguous", "to",
    "result_type", "is_nonzero", "item", "_local_scalar_dense",
))


def _all_launches(decay: bool) -> list[str]:
    """Every launch of one ``linear_attention`` forward and backward (bf16, no
    documents): the Triton kernels from the capture, and PyTorch's from the profiler's
    operator events, counting an operator that calls no other launching one."""
    from hla_sp.kernels import _jit
    from torch.profiler import ProfilerActivity, profile

    device = "cuda" if torch.cuda.is_available() else "cpu"
    T, H, D = 64, 2, 32
    q, k, v = (torch.randn(1, T, H, D, device=device).to(torch.bfloat16).requires_grad_()
               for _ in range(3))
    g = (-0.1 * torch.rand(H, device=device)).requires_grad_() if decay else None
    inputs = [q, k, v] + ([g] if decay else [])
    do = torch.randn(1, T, H, D, device=device).to(torch.bfloat16)

    def step() -> None:
        o, _ = hla_sp.linear_attention(q, k, v, log_decay=g)
        torch.autograd.grad(o, inputs, do)

    with _jit.capture():
        step()  # first calls: imports, tuning caches
    with profile(activities=[ProfilerActivity.CPU]) as prof, _jit.capture() as launched:
        step()

    def launches(e: object) -> bool:
        return e.name.startswith("aten::") and e.name not in NO_LAUNCH  # type: ignore[attr-defined]

    ops = [e.name for e in prof.events()
           if launches(e) and not any(launches(c) for c in e.cpu_children)]
    return ops + [job["kernel"] for job in launched]


@pytest.mark.parametrize("decay", [False, True], ids=["plain", "decay"])
def test_at_most_fifteen_launches_per_step(triton_path: None, decay: bool) -> None:
    """A forward and backward without documents launches at most 15 kernels, PyTorch's
    included: the eight of the primitive, the two zeroed flag buffers, and with a
    per-head decay its value check, its layout and the gradient's sum over [B, T] (on a
    GPU two more of the check: le and _assert_async). q's scale is applied in the
    kernels, and isolation adds no pass: the flags come from the kernels' loads."""
    names = _all_launches(decay)
    assert len(names) <= 15, names
    flag_work = {"aten::amax", "aten::amin", "aten::cumsum", "aten::cummax", "aten::_cummax_helper",
                 "aten::nan_to_num", "aten::abs", "aten::masked_fill_", "aten::where"}
    assert not flag_work & set(names), names


def test_chosen_lists_the_tuners_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a GPU run records of the tuner's choice: one JSON-ready row per key."""
    import json

    from hla_sp.kernels import _tiles

    monkeypatch.setattr(_tiles, "_CHOSEN", {})
    key = ("dqk", torch.bfloat16, 128, 128, 90, torch.bfloat16, None, ("BT", 64))
    _tiles._CHOSEN[key] = _tiles.Config(64, 64, 8, 2, _tiles.SM90)
    rows = _tiles.chosen()
    assert rows == [dict(role="dqk", dtype="bfloat16", K=128, V=128, arch=90,
                         key="torch.bfloat16 None ('BT', 64)", BK=64, BV=64, num_warps=8,
                         num_stages=2)]
    json.dumps(rows)


@pytest.mark.parametrize("arch", [80, 90])
def test_tuner_times_the_archs_candidates_and_keeps_the_fastest(
        monkeypatch: pytest.MonkeyPatch, arch: int) -> None:
    """The GPU path of ``tuned`` with a fake clock: it times every candidate of the
    device's arch (an sm_90-only one never on sm_80), keeps the fastest, and launches
    only that one from the second call on."""
    from hla_sp.kernels import _jit, _tiles

    monkeypatch.setattr(_tiles, "_CHOSEN", {})
    monkeypatch.setattr(_jit, "interpreting", lambda: False)
    monkeypatch.setattr(_tiles, "_device_arch", lambda: arch)
    # the widest K tile is the fastest on this fake clock, then the widest V tile
    monkeypatch.setattr(_tiles, "_time", lambda run: 1.0 / run())
    launched: list[_tiles.Config] = []

    def launch(c: _tiles.Config) -> int:
        launched.append(c)
        return 1000 * c.BK + c.BV

    for _ in range(2):
        _tiles.tuned("out", ("key",), torch.bfloat16, 128, 128, launch)
    cands = _tiles.candidates("out", torch.bfloat16, 128, 128, arch)
    assert set(launched[:-2]) == set(cands) and len(launched) == len(cands) + 2
    assert all(not c.archs or arch in c.archs for c in launched)
    best = max(cands, key=lambda c: (c.BK, c.BV))
    assert launched[-2:] == [best, best]
    assert any(c.archs for c in cands) == (arch == 90)
    # on sm_90 the sm_90-only 128 x 64 is the one this clock favours, and it is chosen
    assert (best.BK, best.BV, best.archs) == ((128, 64, _tiles.SM90) if arch == 90
                                              else (64, 128, ()))

"""Kernel launches of one ``linear_attention`` forward and backward on the Triton path.

Counted with the launch capture of ``hla_sp.kernels._jit`` (the one the ahead-of-time
gate uses): launches are described, not run, so the count is exact and needs no GPU.
The primitive's forward is a state pass and an output kernel; its backward recomputes
the states, runs their gradients in reverse, then dv and dq/dk/dg: six launches, with
or without a decay, documents or states (no serial decay-gradient pass, no separate
chunk-state kernel); hla2, two passes of the primitive, twelve. Under
``capture(every=True)`` every tuning candidate of a launch is described as well,
which is what the gate compiles.
"""

from __future__ import annotations

import pytest
import torch

import hla_sp

STEP = ["chunk_fwd_h_kernel", "chunk_fwd_o_kernel", "chunk_fwd_h_kernel",
        "chunk_bwd_dh_kernel", "chunk_bwd_dv_kernel", "chunk_bwd_dqk_kernel"]


@pytest.fixture
def triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HLA_SP_BACKEND", "triton")


def _step(dtype: torch.dtype, docs: bool, every: bool = False, op: str = "linear_attention"
          ) -> list[str]:
    """The kernels one forward and backward launches, in order."""
    from hla_sp.kernels import _jit

    device = "cuda" if torch.cuda.is_available() else "cpu"
    T, H, D = 40, 2, 32

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
    return [job["kernel"] for job in launched]


@pytest.mark.parametrize("docs", [False, True], ids=["plain", "docs-states"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_six_launches_per_step(triton_path: None, dtype: torch.dtype, docs: bool) -> None:
    assert _step(dtype, docs) == STEP


def test_hla2_is_two_primitive_steps(triton_path: None) -> None:
    """hla2 runs the primitive twice (k~ = LA(q, k, k), then LA(q, k~, v)), forward and
    backward: twelve launches, the same six kernels twice."""
    launched = _step(torch.bfloat16, docs=False, op="hla2")
    assert len(launched) == 12 and sorted(launched) == sorted(STEP + STEP)


def test_capture_every_candidate(triton_path: None) -> None:
    """The gate's capture describes each tuning candidate once per launch (bf16 at
    K = V = 32: the 64- and 128-wide candidates resolve to one 32-wide tile, so the
    distinct ones are those differing in warps or tiles)."""
    from hla_sp.kernels._tiles import candidates

    every = _step(torch.bfloat16, docs=False, every=True)
    roles = {"chunk_fwd_h_kernel": "state", "chunk_bwd_dh_kernel": "state",
             "chunk_fwd_o_kernel": "out", "chunk_bwd_dv_kernel": "out",
             "chunk_bwd_dqk_kernel": "dqk"}
    want = sum(len(candidates(roles[name], torch.bfloat16, 32, 32)) for name in STEP)
    assert len(every) == want > len(STEP)
    assert set(every) == set(STEP)

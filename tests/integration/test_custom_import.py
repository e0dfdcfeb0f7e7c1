"""``--custom-import MODULE``: a user's operator, registered by their own module, trained
with ``hla-sp train`` under context parallelism, sampled by ``hla-sp generate`` (which
imports the module the run recorded), and accepted by Megatron's entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

USER_MODULE = '''"""A user's operator: o = LA(q, k, LA(q, q, v)), registered on import."""
from typing import NamedTuple

import torch

from hla_sp.ops import operators
from hla_sp.ops.runner import run_operator


class QQVState(NamedTuple):
    A: torch.Tensor  # [N, Hq, K, V], sum q v^T
    H: torch.Tensor  # [N, Hq, K, V], sum k u^T


def qqv_stages(ctx, qs, k, v, state0):
    A0, H0 = state0
    u, A = ctx.per_head(qs, qs, ctx.expand(v), A0)
    o, H = ctx.per_head(qs, ctx.expand(k), ctx.value(u, v), H0)
    return o, [A, H]


def qqv(q, k, v, **kw):
    return run_operator("qqv", q, k, v, **kw)


def qqv_reference(q, k, v, log_decay=None, scale=None, initial_state=None):
    """A_t = g A + q_t v_t^T, u_t = A_t^T q_t, H_t = g H + k_t u_t^T, o_t = H_t^T q_t."""
    B, T, H, K = q.shape
    qs = q * (K ** -0.5 if scale is None else scale)
    g = torch.zeros(B, T, H, dtype=q.dtype) if log_decay is None else \\
        torch.broadcast_to(log_decay, (B, T, H)).to(q.dtype)
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


operators.register(operators.OperatorSpec(
    "qqv", QQVState,
    (operators.Field("A", "q", ("K", "V")), operators.Field("H", "q", ("K", "V"))),
    qqv_stages, public=qqv, reference=qqv_reference, value_mix=True, higher_order=True))
'''

TRAIN = ["--nproc-per-node", "2", "--context-parallel-size", "2", "--num-layers", "1",
         "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "64",
         "--micro-batch-size", "2", "--train-iters", "2", "--log-interval", "1"]


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(cwd), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "hla_sp.launch.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture
def user_module(tmp_path: Path) -> Path:
    (tmp_path / "qqv_user_op.py").write_text(USER_MODULE)
    return tmp_path


def test_the_user_operator_equals_its_recurrence(user_module: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's operator is a real one: its stages equal its serial recurrence."""
    import importlib

    import torch

    from hla_sp.ops import operators

    monkeypatch.syspath_prepend(str(user_module))
    mod = importlib.import_module("qqv_user_op")
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 13, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
        decay = -torch.rand(1, 13, 2, generator=g, dtype=torch.float64)
        o, st = mod.qqv(q, k, v, log_decay=decay, output_final_state=True, chunk_size=4)
        o_ref, st_ref = mod.qqv_reference(q, k, v, decay)
        torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
        for a, b in zip(st, st_ref):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    finally:
        operators.unregister("qqv")
        sys.modules.pop("qqv_user_op", None)


def test_custom_imports_reads_both_spellings_and_refuses_a_bare_flag() -> None:
    from hla_sp.megatron_patch.args import custom_imports

    assert custom_imports(["--lr", "1", "--custom-import", "a.b", "--custom-import=c"]) == [
        "a.b", "c"]
    with pytest.raises(ValueError, match="--custom-import: expected a module name"):
        custom_imports(["--custom-import", "--lr"])


def test_a_module_that_fails_is_one_line_naming_it(user_module: Path) -> None:
    r = _cli(["train", "--custom-import", "no_such_user_module", *TRAIN], user_module)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--custom-import no_such_user_module: cannot import it" in lines[0]


def test_user_operator_trains_under_cp_and_generates(user_module: Path) -> None:
    """The module's operator is accepted by --attention in the launcher and in every
    worker, trains at CP 2, and its checkpoint samples without naming the module again;
    without the module, --attention refuses the name in one line."""
    r = _cli(["train", "--custom-import", "qqv_user_op", "--attention", "qqv", *TRAIN,
              "--save", "ck"], user_module)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "qqv GPT" in r.stdout and "saved checkpoint" in r.stdout
    g = _cli(["generate", "--load", "ck", "--max-new-tokens", "4", "--temperature", "0"],
             user_module)
    assert g.returncode == 0, g.stderr
    assert "decoded 4 tokens" in g.stderr
    bare = _cli(["train", "--attention", "qqv", *TRAIN], user_module)
    assert bare.returncode == 2
    assert "--attention: invalid choice: 'qqv'" in bare.stderr, bare.stderr


def test_megatron_entry_point_takes_the_user_operator(user_module: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron's entry point imports the module before it reads --attention: the flags
    pass its checks (it then stops only where megatron.training is missing here)."""
    from hla_sp.megatron_patch import pretrain_gpt

    from hla_sp.config import hla_operator_names
    from hla_sp.ops import operators

    monkeypatch.syspath_prepend(str(user_module))
    monkeypatch.setattr(pretrain_gpt, "run", lambda ns, spec: None)  # no training here
    flags = ["--attention", "qqv", "--num-layers", "2"]
    try:
        without = pretrain_gpt.main(flags)
        assert without == pretrain_gpt.EXIT_BAD_FLAGS
        code = pretrain_gpt.main(["--custom-import", "qqv_user_op", *flags])
        assert code != pretrain_gpt.EXIT_BAD_FLAGS
        assert "qqv" in hla_operator_names()
    finally:
        if "qqv" in operators.TABLE:
            operators.unregister("qqv")
        sys.modules.pop("qqv_user_op", None)

"""A table of the operators under test: the fast path, its recurrence, its naive form.

Every entry maps to functions of ``(q, k, v, g, init, want_final, chunk)`` returning
``(o, state tuple | None)``, so a test can loop over operators without special
cases. The fast path is the public API; the references are ``hla_sp.ops.reference``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

import hla_sp
from hla_sp.ops import reference as R


@dataclass(frozen=True)
class Op:
    name: str
    fast: Callable  # (q, k, v, g, init, want_final, chunk, **kw) -> (o, tuple | None)
    recurrent: Callable  # (q, k, v, g, init) -> (o, tuple)
    naive: Callable  # (q, k, v, g) -> o
    state_shapes: Callable[[int, int, int, int], list[tuple[int, ...]]]  # (N, H, K, V)
    positive: bool = False  # needs q.k >= 0 inputs (normalize's denominator)


def _as_tuple(state):
    if state is None:
        return None
    return tuple(state) if isinstance(state, tuple) else (state,)


def _fast(fn, **opts):
    def run(q, k, v, g, init=None, want_final=False, chunk=16, **kw):
        if init is not None and fn is hla_sp.linear_attention:
            init = init[0]
        o, st = fn(
            q,
            k,
            v,
            log_decay=g,
            initial_state=init,
            output_final_state=want_final,
            chunk_size=chunk,
            **opts,
            **kw,
        )
        st = _as_tuple(st)
        if st is not None and len(st) == 3 and st[2] is None:  # HLA2State without eta
            st = st[:2]
        return o, st

    return run


def _rec_la(q, k, v, g, init=None):
    o, h = R.recurrent_linear_attention(q, k, v, g, initial_state=None if init is None else init[0])
    return o, (h,)


def _rec_hla2(**opts):
    def run(q, k, v, g, init=None):
        o, st = R.recurrent_hla2(q, k, v, g, initial_state=init, **opts)
        return o, tuple(x for x in st if x is not None)

    return run


def _kv(N, H, K, V):
    return [(N, H, K, V)]


OPS = [
    Op(
        "linear",
        _fast(hla_sp.linear_attention),
        _rec_la,
        lambda q, k, v, g: R.naive_linear_attention(q, k, v, g)[0],
        _kv,
    ),
    Op(
        "hla2",
        _fast(hla_sp.hla2),
        _rec_hla2(),
        lambda q, k, v, g: R.naive_hla2(q, k, v, g),
        lambda N, H, K, V: [(N, H, K, K), (N, H, K, V)],
    ),
    Op(
        "hla2_ridge",
        _fast(hla_sp.hla2, ridge=0.5),
        _rec_hla2(ridge=0.5),
        lambda q, k, v, g: R.naive_hla2(q, k, v, g, ridge=0.5),
        lambda N, H, K, V: [(N, H, K, K), (N, H, K, V)],
    ),
    Op(
        "hla2_norm",
        _fast(hla_sp.hla2, normalize=True),
        _rec_hla2(normalize=True),
        lambda q, k, v, g: R.naive_hla2(q, k, v, g, normalize=True),
        lambda N, H, K, V: [(N, H, K, K), (N, H, K, V), (N, H, K)],
        positive=True,
    ),
    Op(
        "ahla",
        _fast(hla_sp.ahla),
        lambda q, k, v, g, init=None: R.recurrent_ahla(q, k, v, g, initial_state=init),
        lambda q, k, v, g: R.naive_ahla(q, k, v, g),
        lambda N, H, K, V: [(N, H, K, V), (N, H, K, V)],
    ),
    Op(
        "hla3",
        _fast(hla_sp.hla3),
        lambda q, k, v, g, init=None: R.recurrent_hla3(q, k, v, g, initial_state=init),
        lambda q, k, v, g: R.naive_hla3(q, k, v, g),
        lambda N, H, K, V: [(N, H, K, K), (N, H, K, V), (N, H, K, V)],
    ),
    Op(
        "ccq",
        _fast(hla_sp.ccq),
        lambda q, k, v, g, init=None: R.recurrent_ccq(q, k, v, g, initial_state=init),
        lambda q, k, v, g: R.naive_ccq(q, k, v, g),
        lambda N, H, K, V: [(N, H, K, K), (N, H, K, V)],
    ),
]
OPS_BY_NAME = {op.name: op for op in OPS}


def make_inputs(
    B: int,
    T: int,
    H: int,
    K: int,
    V: int,
    *,
    decay: str = "token",
    dtype: torch.dtype = torch.float64,
    positive: bool = False,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random q, k [B, T, H, K], v [B, T, H, V] and a log-decay of the asked kind.

    decay: "none" (None), "zero" (an all-zero tensor), "head" ([H]) or "token" ([B, T, H]).
    positive: q, k >= 0 so that normalize's denominator stays away from zero.
    """
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    if positive:
        q, k = q.abs(), k.abs()
    if decay == "none":
        g = None
    elif decay == "zero":
        g = torch.zeros(H, dtype=torch.float64)
    elif decay == "head":
        g = -torch.rand(H, generator=gen, dtype=torch.float64) * 0.2 - 0.01
    elif decay == "token":
        g = -torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.3
    else:
        raise ValueError(f"decay: expected none|zero|head|token, got {decay!r}")
    cast = (lambda x: x.to(dtype)) if dtype != torch.float64 else (lambda x: x)
    return cast(q), cast(k), cast(v), (None if g is None else cast(g))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Normwise relative error max|a - b| / max|b| (max|b| floored at tiny)."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()

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
from hla_sp.config import BUILTIN_OPERATORS
from hla_sp.ops import operators
from hla_sp.ops import reference as R


@dataclass(frozen=True)
class Op:
    name: str
    fast: Callable  # (q, k, v, g, init, want_final, chunk, **kw) -> (o, tuple | None)
    recurrent: Callable  # (q, k, v, g, init) -> (o, tuple)
    naive: Callable  # (q, k, v, g) -> o: the quadratic form, or the recurrence without one
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


def _recurrence(spec, **opts):
    """The table's serial recurrence of ``spec`` as (q, k, v, g, init) -> (o, tuple)."""

    def run(q, k, v, g, init=None):
        if init is not None and spec.bare_state:
            init = init[0]
        o, st = spec.reference(q, k, v, g, initial_state=init, **opts)
        return o, _as_tuple(st) if spec.bare_state else tuple(x for x in st if x is not None)

    return run


def _shapes(spec, **opts):
    """The state's field shapes (N, H, K, V) -> list, for these options (the table's)."""
    on = dict(opts)

    def shapes(N, H, K, V):
        dims = {"K": K, "V": V}
        return [(N, H, *(dims[d] for d in f.dims)) for f in spec.fields
                if f.when is None or on.get(f.when)]

    return shapes


# The naive quadratic forms, where one is written (an operator without one is checked
# against its recurrence in their place).
NAIVE = {
    "linear": lambda q, k, v, g, **o: R.naive_linear_attention(q, k, v, g)[0],
    "hla2": R.naive_hla2,
    "ahla": R.naive_ahla,
    "hla3": R.naive_hla3,
    "ccq": R.naive_ccq,
}


def _op(name: str, base: str, positive: bool = False, **opts) -> Op:
    spec = operators.get(base)
    naive = NAIVE.get(base)
    rec = _recurrence(spec, **opts)
    return Op(
        name,
        _fast(spec.public, **opts),
        rec,
        (lambda q, k, v, g: rec(q, k, v, g)[0]) if naive is None
        else (lambda q, k, v, g: naive(q, k, v, g, **opts)),
        _shapes(spec, **opts),
        positive=positive,
    )


# Every built-in operator of the table (a new one is covered at once), then hla2's
# options.
OPS = [_op(n, n) for n in BUILTIN_OPERATORS] + [
    _op("hla2_ridge", "hla2", ridge=0.5),
    _op("hla2_norm", "hla2", positive=True, normalize=True),
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

"""A registered operator against its own serial reference, at registration.

:func:`hla_sp.ops.table.register` runs the operator's public function (its stages,
chunked) and its ``reference`` on one small fp64 input with a decay, two chunks long,
and refuses the operator when they differ beyond fp64 rounding: an operator whose
stages and reference disagree would train one thing and be documented as another.
"""

from __future__ import annotations

from typing import Any

import torch

# fp64 rounding of the stages' chunked sums against the serial recurrence, far above the
# ~1e-15 relative seen, far below any error of the maths
TOLERANCE = 1e-9
SHAPE = dict(B=1, T=8, H=2, K=4, V=4)
CHUNK = 4


def check(spec: Any) -> None:
    """Raise ValueError naming ``spec`` when its public function and its reference differ
    on the small fp64 input (or either fails on it)."""
    s = SHAPE
    gen = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * 0.5

    q, k, v = r(s["B"], s["T"], s["H"], s["K"]), r(s["B"], s["T"], s["H"], s["K"]), \
        r(s["B"], s["T"], s["H"], s["V"])
    g = -torch.rand(s["B"], s["T"], s["H"], generator=gen, dtype=torch.float64) * 0.4
    where = f"operator {spec.name!r}"
    try:
        with torch.no_grad():
            o = spec.public(q, k, v, log_decay=g, chunk_size=CHUNK)[0]
            ref = spec.reference(q, k, v, g)[0]
    except Exception as e:  # the user's code: whatever it raises, say where
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"spec: {where} fails its registration check (its public function "
                         f"and its reference on a {s['T']}-token fp64 input): "
                         f"{type(e).__name__}: {first}") from None
    if o.shape != ref.shape:
        raise ValueError(f"spec.reference: {where}'s output has shape {tuple(o.shape)}, its "
                         f"reference's {tuple(ref.shape)}")
    err = float((o - ref).abs().max() / ref.abs().max().clamp_min(1e-300))
    if not err <= TOLERANCE:
        raise ValueError(f"spec.reference: {where}'s stages differ from its reference by "
                         f"{err:.2e} of the largest output on a {s['T']}-token fp64 input "
                         f"(expected <= {TOLERANCE:g}): the stages or the reference are wrong")

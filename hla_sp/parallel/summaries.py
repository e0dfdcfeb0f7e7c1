"""Segment summaries of the primitive and their associative operator ⊕ (docs/math.md §4).

A summary of a contiguous segment is (h, a, s): the state the segment produces from a
zero state [B, H, K, V], its total log-decay [B, H], and a flag s, 1 when the
segment contains a document start (the carry is cut there). For an earlier segment
A and a later segment B:

    A ⊕ B = (exp(a_B) (1 - s_B) h_A + h_B,  a_A + a_B,  max(s_A, s_B))    identity (0, 0, 0)

Summaries travel between ranks packed in one flat buffer [D], D = BHKV + BH + 1, in
fp32 (fp64 for fp64 inputs) whatever the input dtype: bf16 states lose the small
contributions of long-decayed history.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SummaryShape:
    """Sizes of one packed summary."""

    B: int
    H: int
    K: int
    V: int

    @property
    def n_state(self) -> int:
        return self.B * self.H * self.K * self.V

    @property
    def size(self) -> int:
        """D, the number of elements of one packed summary."""
        return self.n_state + self.B * self.H + 1


def pack(shape: SummaryShape, h: torch.Tensor, a: torch.Tensor, start: bool) -> torch.Tensor:
    """(h [B, H, K, V], a [B, H], start) -> [D]."""
    flag = h.new_full((1,), 1.0 if start else 0.0)
    return torch.cat([h.reshape(-1), a.reshape(-1).to(h.dtype), flag])


def unpack(shape: SummaryShape, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., D] -> h [..., B, H, K, V], a [..., B, H], s [...]."""
    lead = x.shape[:-1]
    n = shape.n_state
    h = x[..., :n].reshape(*lead, shape.B, shape.H, shape.K, shape.V)
    a = x[..., n : n + shape.B * shape.H].reshape(*lead, shape.B, shape.H)
    return h, a, x[..., -1]


def identity(shape: SummaryShape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The neutral summary of an empty segment."""
    return torch.zeros(shape.size, dtype=dtype, device=device)


def combine(shape: SummaryShape, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x ⊕ y for x earlier than y; both [..., D]."""
    hx, ax, sx = unpack(shape, x)
    hy, ay, sy = unpack(shape, y)
    sy = sy.detach()  # a flag, not a variable
    p = torch.exp(ay) * (1.0 - sy)[..., None, None]  # [..., B, H]
    # A cut (a document start, a hard reset) passes nothing of x, not even a NaN: a
    # select, and a second one so that no NaN of hx reaches the gradient of a_y.
    cut = (p == 0)[..., None, None]
    h = torch.where(cut, hy, p[..., None, None] * torch.where(cut, 0.0, hx) + hy)
    s = torch.maximum(sx.detach(), sy)
    return torch.cat([h.flatten(-4), (ax + ay).flatten(-2), s[..., None]], dim=-1)


def combine_vjp(
    shape: SummaryShape, x: torch.Tensor, y: torch.Tensor, d_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ⊕ with respect to x and y, given d(x ⊕ y); all [..., D].

    Written out rather than taken by autograd: ring and tree run it on a helper thread
    while the main thread is inside the backward pass. With w = exp(a_y) (1 - s_y):
    dh_x = w dh, dh_y = dh, da_x = da, da_y = da + w <h_x, dh>; the flags get none.
    Where w = 0 (a cut) the w terms are 0 by a select, whatever h_x or dh hold.
    """
    hx, _, _ = unpack(shape, x)
    _, ay, sy = unpack(shape, y)
    dh, da, _ = unpack(shape, d_out)
    w = torch.exp(ay) * (1.0 - sy)[..., None, None]  # [..., B, H]
    cut = w == 0  # nothing of x crosses it, in either direction: selects, not products
    dhx = torch.where(cut[..., None, None], 0.0, w[..., None, None] * dh)
    day = da + torch.where(cut, 0.0, w * (hx * dh).sum((-1, -2)))
    zero = d_out[..., -1:].new_zeros(d_out[..., -1:].shape)
    dx = torch.cat([dhx.flatten(-4), da.flatten(-2), zero], dim=-1)
    dy = torch.cat([dh.flatten(-4), day.flatten(-2), zero], dim=-1)
    return dx, dy


def exclusive_prefixes(shape: SummaryShape, xs: torch.Tensor, want: list[int]) -> torch.Tensor:
    """Left fold: for each m in ``want``, x_0 ⊕ ... ⊕ x_{m-1} (identity for m = 0).

    Args:
        xs: [M, D] summaries in global order. Returns [len(want), D].
    """
    out: dict[int, torch.Tensor] = {}
    acc = identity(shape, xs.dtype, xs.device)
    last = max(want, default=-1)
    for m in range(last + 1):
        if m in want:
            out[m] = acc
        if m < last:
            acc = combine(shape, acc, xs[m])
    if not want:
        return xs.new_zeros(0, shape.size)
    return torch.stack([out[m] for m in want])

"""Segment summaries of the primitive and their associative operator ⊕ (docs/math.md §4).

A summary of a contiguous segment is (h, a, s): the state the segment produces from a
zero state [B, H, K, V], its total log-decay [B, H], and a flag s, 1 when the
segment contains a document start (the carry is cut there). For an earlier segment
A and a later segment B:

    A ⊕ B = (exp(a_B) (1 - s_B) h_A + h_B,  a_A + a_B,  max(s_A, s_B))    identity (0, 0, 0)

Summaries travel between ranks packed in one flat buffer [D], D = BHKV + BH + 1, in
fp32 (fp64 for fp64 inputs) whatever the input dtype: bf16 states lose the small
contributions of long-decayed history.

With ``SummaryShape.signed`` the buffer also carries the call's signature, three words
of 21 bits (exact in fp32) just before the flag, D = BHKV + BH + 4: every rank's
signature then rides in the exchange the math makes anyway, and where every rank sees
every piece (the all-gather) :func:`exclusive_prefixes` compares them on the device
(:func:`verify_signatures`; the agreement design is in :mod:`hla_sp.parallel.engine`).
The signature words are constants: ⊕ keeps the later operand's, and they get no
gradient.
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
    signed: bool = False  # the buffer carries the call's signature (SIGNATURE_WORDS)

    @property
    def n_state(self) -> int:
        return self.B * self.H * self.K * self.V

    @property
    def n_sig(self) -> int:
        return SIGNATURE_WORDS if self.signed else 0

    @property
    def size(self) -> int:
        """D, the number of elements of one packed summary."""
        return self.n_state + self.B * self.H + self.n_sig + 1


# A 63-bit signature as three 21-bit words: exact in fp32 and fp64.
SIGNATURE_WORDS, _WORD_BITS = 3, 21
SIGNATURE_MISMATCH = "SequenceParallel: the ranks' call signatures differ"


def signature_words(sig: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An int64 signature (a 0-d tensor, any device) -> [SIGNATURE_WORDS] of ``dtype``."""
    mask = (1 << _WORD_BITS) - 1
    parts = [(sig >> (_WORD_BITS * i)) & mask for i in range(SIGNATURE_WORDS)]
    return torch.stack(parts).to(dtype)


def verify_signatures(words: torch.Tensor) -> None:
    """Assert, on the device, that every row of ``words`` [n, SIGNATURE_WORDS] is the
    same: no host read. On CPU a mismatch raises a RuntimeError naming
    ``SIGNATURE_MISMATCH`` at once; on an accelerator the assert is ordered on the
    stream before every later collective, so no rank runs one past it."""
    if words.shape[0] > 1:
        torch._assert_async((words == words[:1]).all(), SIGNATURE_MISMATCH)


def pack(
    shape: SummaryShape, h: torch.Tensor, a: torch.Tensor, start: bool,
    sig: torch.Tensor | None = None,
) -> torch.Tensor:
    """(h [B, H, K, V], a [B, H], start) -> [D]; ``sig``: the words of
    :func:`signature_words` (required when ``shape.signed``)."""
    flag = h.new_full((1,), 1.0 if start else 0.0)
    parts = [h.reshape(-1), a.reshape(-1).to(h.dtype)]
    if shape.signed:
        parts.append(sig.to(device=h.device, dtype=h.dtype))  # type: ignore[union-attr]
    return torch.cat([*parts, flag])


def signed_identity(shape: SummaryShape, dtype: torch.dtype, device: torch.device,
                    sig: torch.Tensor | None) -> torch.Tensor:
    """The identity summary carrying ``sig`` (the summary of an empty piece)."""
    x = identity(shape, dtype, device)
    if shape.signed:
        n = shape.n_state + shape.B * shape.H
        x[n : n + SIGNATURE_WORDS] = sig.to(device=device, dtype=dtype)  # type: ignore[union-attr]
    return x


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
    sig = _sig(shape, y.detach())
    return torch.cat([h.flatten(-4), (ax + ay).flatten(-2), sig, s[..., None]], dim=-1)


def _sig(shape: SummaryShape, x: torch.Tensor) -> torch.Tensor:
    """The signature words of x [..., D] ([..., 0] when unsigned)."""
    n = shape.n_state + shape.B * shape.H
    return x[..., n : n + shape.n_sig]


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
    zero = d_out[..., -1:].new_zeros(*d_out.shape[:-1], shape.n_sig + 1)
    dx = torch.cat([dhx.flatten(-4), da.flatten(-2), zero], dim=-1)
    dy = torch.cat([dh.flatten(-4), day.flatten(-2), zero], dim=-1)
    return dx, dy


def exclusive_prefixes(shape: SummaryShape, xs: torch.Tensor, want: list[int]) -> torch.Tensor:
    """Left fold: for each m in ``want``, x_0 ⊕ ... ⊕ x_{m-1} (identity for m = 0).

    Args:
        xs: [M, D] summaries in global order (every piece: with a signature, they
            are compared here first). Returns [len(want), D].
    """
    if shape.signed:
        verify_signatures(_sig(shape, xs.detach()))
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

"""Document isolation under non-finite inputs: clean operands, poison by flags.

Packed documents and hard resets (a log-decay of -inf) cut a sequence into
*segments*. A NaN or an infinity in one segment must reach no other segment, and
within its segment no earlier output. Masks cannot promise that: a matmul adds
0 * NaN = NaN, so a zero weight on a non-finite operand still poisons every row it is
summed into, whatever selects the weights went through. So every path computes on
*clean* operands, the non-finite entries replaced by 0 (in place on the copies the
chunk paths make anyway, or at the load in the Triton kernels; q may stay as it is
where it reaches only its own output row), and puts the poison back by flags, with
selects:

- forward: an output is NaN when a token at or before it in its segment had a
  non-finite k, v or decay (its own non-finite q makes it NaN by itself), or when its
  segment is the first one and the carried-in state is non-finite; a final state is
  NaN when its segment's output would be;
- backward: every gradient of a segment is NaN when anything of it (q, k, v, decay,
  the outputs' cotangent, its carried-in or final state's) is non-finite.

Everything here is [B, T, H] flags (1/K of the inputs) and selects on tensors that
exist already; there is no host synchronisation. This module serves the PyTorch chunk
path, the fused hla2, sequence parallelism and the documents' carries; the Triton
kernels of the primitive raise the same flags from their own loads and put the poison
back in their own gated launch (``hla_sp.kernels.poison``, the same rules, tested
against these). One limit remains: finite inputs so
large that a product overflows make an inf inside the arithmetic, which is not
tracked.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor
NAN = float("nan")


def finite(x: Tensor, source: Tensor | None = None) -> Tensor:
    """x with every NaN and ±inf set to 0; in place when x does not share ``source``'s
    storage (a copy the caller made anyway), else a new tensor."""
    if source is None or x.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
        return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    return torch.nan_to_num_(x, nan=0.0, posinf=0.0, neginf=0.0)


def finite_decay(g: Tensor) -> Tensor:
    """A log-decay with NaN and +inf set to 0 (poisoned anyway) and -inf kept: a hard
    reset is a cut, not a poison. A new tensor; the gradient passes where g is kept."""
    return torch.where(g < float("inf"), g, 0.0)


def bad_rows(x: Tensor) -> Tensor:
    """[..., D] -> [...] bool: the rows holding a NaN or an infinity.

    From each row's max and min: both propagate a NaN, and an infinity is one of the
    two. Two reductions that read x once each and write nothing of its size, where
    ``isfinite(x).all(-1)`` writes four x-sized temporaries (measured 5.5x slower on
    [1, 16k, 4, 64] fp32, 1 thread; these flags were a quarter of hla2's time)."""
    if x.shape[-1] == 0:
        return torch.zeros(x.shape[:-1], dtype=torch.bool, device=x.device)
    return ~(torch.isfinite(x.amax(-1)) & torch.isfinite(x.amin(-1)))


def poison_(x: Tensor, flag: Tensor) -> Tensor:
    """In place: NaN into x [*flag.shape, ...] wherever ``flag`` (bool) is True; x.

    An add of NaN or 0 broadcast over x's trailing dims: x + 0 is x (a -0.0 becomes
    +0.0, equal under every comparison), and on CPU it is 2.3x faster than
    ``masked_fill_`` with a broadcast bool mask ([1, 16k, 4, 64] fp32, 1 thread: 2.6 ms
    against 6.0 ms)."""
    if x.numel() == 0:
        return x
    add = torch.zeros(flag.shape, dtype=x.dtype, device=x.device).masked_fill_(flag, NAN)
    return x.add_(add.view(*flag.shape, *(1,) * (x.dim() - flag.dim())))


def bad_state(h: Tensor | None) -> Tensor | None:
    """[B, H, K, V] -> [B, H] bool: the states holding a NaN or an infinity (None: None)."""
    return None if h is None else bad_rows(h).any(-1)


def bad_tokens(k: Tensor, v: Tensor, g: Tensor | None) -> Tensor:
    """[B, T, H] bool: the tokens whose k, v or log-decay (NaN or +inf) is non-finite, that
    is whose value reaches the later outputs of their segment."""
    bad = bad_rows(k) | bad_rows(v)
    if g is not None:
        bad |= ~(g < float("inf"))  # NaN or +inf; -inf is a cut
    return bad


def cuts(resets: Tensor | None, g: Tensor | None, like: Tensor) -> Tensor | None:
    """[B, T, H] bool, True where a segment starts: a document start (``resets`` [B, T])
    or a hard reset (g == -inf); None when there is neither. ``like``: [B, T, H, .]."""
    c = None
    if resets is not None:
        c = resets.to(torch.bool)[..., None].expand(like.shape[:3])
    if g is not None:
        hard = g == float("-inf")
        c = hard if c is None else c | hard
    return c


def _time_last(x: Tensor) -> Tensor:
    """[B, T, H] -> [B, H, T], contiguous, for the scans over time below.

    A scan along a middle dimension runs, on CUDA, one thread per (B, H) column serially
    over T; along the last dimension it is a parallel scan. Measured on an H200 at
    [1, 32k, 16]: 3-6 ms a scan, 55% of linear_attention's forward and backward."""
    return x.transpose(1, 2).contiguous()


def _count(x: Tensor) -> Tensor:
    """[B, H, T] bool -> int32 running count along T (T < 2^31; half of int64's bytes)."""
    return x.cumsum(-1, dtype=torch.int32)


def poisoned_prefix(bad: Tensor, cut: Tensor | None, init: Tensor | None = None) -> Tensor:
    """[B, T, H] bool: True at t when a bad token lies at or before t in t's segment, or
    t's segment is the first one and ``init`` [B, H] (a bad carried-in state) is True."""
    bad_t = _time_last(bad)
    cb = _count(bad_t)
    if cut is None:
        out = cb > 0
        return (out if init is None else out | init[..., None]).transpose(1, 2)
    cut_t = _time_last(cut)
    # the count before each segment's start, carried over the segment (counts only grow)
    base = torch.where(cut_t, cb - bad_t.int(), 0).cummax(-1).values
    out = cb > base
    if init is not None:
        out |= init[..., None] & (_count(cut_t) == 0)
    return out.transpose(1, 2)


def poisoned_segments(
    bad: Tensor, cut: Tensor | None, first: Tensor | None = None, last: Tensor | None = None
) -> Tensor:
    """[B, T, H] bool: True on every token of a segment that holds a bad token, of the
    first segment when ``first`` [B, H] is True, of the last when ``last`` [B, H] is."""
    if cut is None:
        out = bad.any(1, keepdim=True).expand_as(bad)
        for extra in (first, last):
            if extra is not None:
                out = out | extra[:, None]
        return out
    T = bad.shape[1]
    bad_t, cut_t = _time_last(bad), _time_last(cut)
    cb = _count(bad_t)
    base = torch.where(cut_t, cb - bad_t.int(), 0).cummax(-1).values
    # the count at each segment's last token, carried back over the segment
    ends = torch.cat([cut_t[..., 1:], torch.ones_like(cut_t[..., :1])], dim=-1)
    top = torch.where(ends, cb, T + 1).flip(-1).cummin(-1).values.flip(-1)
    out = top > base
    if first is not None:
        out |= first[..., None] & (_count(cut_t) == 0)
    if last is not None:
        after = _count(cut_t.flip(-1)).flip(-1) - cut_t.int()  # cuts strictly after t
        out |= last[..., None] & (after == 0)
    return out.transpose(1, 2)


def poison_outputs(
    o: Tensor, h_last: Tensor | None, bad: Tensor, g: Tensor | None,
    resets: Tensor | None, h0: Tensor | None,
) -> None:
    """In place: NaN into o [B, T, H, V] and h_last [B, H, K, V] where the forward's
    poison reaches (module note); ``bad`` [B, T, H]: :func:`bad_tokens` of k, v, g. q
    needs no flag: a non-finite q_t makes o_t NaN by itself, and no other output reads
    it."""
    init = bad_state(h0)
    if o.shape[1] == 0:
        if h_last is not None and init is not None:
            poison_(h_last, init)
        return
    pz = poisoned_prefix(bad, cuts(resets, g, o), init)
    poison_(o, pz)
    if h_last is not None:
        poison_(h_last, pz[:, -1])


def backward_flags(q: Tensor, bad: Tensor, do: Tensor) -> Tensor | None:
    """[B, T, H] bool: the tokens whose q, k, v, decay or output cotangent is non-finite
    (``bad``: the forward's :func:`bad_tokens`); None for T = 0."""
    return None if q.shape[1] == 0 else bad | bad_rows(q) | bad_rows(do)


def known_finite(x: Tensor, *flags: Tensor | None) -> bool:
    """Whether x is on the CPU and none of ``flags`` is set: the cleaning and the
    poisoning are then identities, and the torch path skips them.

    Only on the CPU, where reading a flag is a read of host memory, not a device
    synchronisation; on a GPU nothing is read and every step runs (the Triton kernels
    clean at the load). The flags are computed either way: they decide the poison."""
    if x.device.type != "cpu":
        return False
    return not any(bool(f.any()) for f in flags if f is not None)


def poison_grads(
    grads: list[Tensor | None], dh0: Tensor | None, q: Tensor, bad: Tensor | None,
    g: Tensor | None, resets: Tensor | None, h0: Tensor | None, dht: Tensor | None,
) -> None:
    """In place: NaN into the per-token gradients ``grads`` ([B, T, H, .] or dg [B, T, H])
    and dh0 [B, H, K, V] on every segment the backward's poison reaches (module note);
    ``bad`` [B, T, H]: :func:`backward_flags` (None for T = 0)."""
    poison_segments(grads, [dh0], bad, cuts(resets, g, q), bad_state(h0), bad_state(dht))


def either(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    """a | b for optional flags."""
    return b if a is None else a if b is None else a | b


def poison_segments(
    grads: list[Tensor | None], dstates0: list[Tensor | None], bad: Tensor | None,
    cut: Tensor | None, first: Tensor | None, last: Tensor | None,
) -> None:
    """In place: NaN into the per-token gradients ``grads`` ([B, T, H, .] or [B, T, H])
    of every poisoned segment (:func:`poisoned_segments` of ``bad`` [B, T, H], None for
    T = 0), and into the initial states' gradients ``dstates0`` ([B, H, ., .]) when the
    first segment is poisoned."""
    if bad is None:
        reach = either(first, last)
    else:
        seg = poisoned_segments(bad, cut, first, last)
        for x in grads:
            if x is not None:
                poison_(x, seg)
        reach = seg[:, 0]
    if reach is not None:
        for d in dstates0:
            if d is not None:
                poison_(d, reach)


def carry_into(h: Tensor, a: Tensor, c: Tensor | None) -> Tensor:
    """h + exp(a) c for a state c [B, H, K, V] carried over a segment of total log-decay
    a [B, H] (zero-state state h): a hard reset inside (a = -inf) cuts c, even a
    non-finite one; otherwise a non-finite c makes the result NaN. Differentiable, and
    no NaN reaches the gradients of h or a from a cut c."""
    if c is None:
        return h
    w = torch.exp(a)[..., None, None]
    bad = bad_state(c)
    out = h + w * torch.nan_to_num(c.to(h.dtype), nan=0.0, posinf=0.0, neginf=0.0)
    return torch.where((bad & ~torch.isneginf(a))[..., None, None], NAN, out)

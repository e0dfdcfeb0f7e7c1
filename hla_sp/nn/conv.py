"""A short causal depthwise convolution over time, exact across documents, states and ranks.

y_t = silu(sum_{d < W} w_d * x_{t-d}) per channel, where a tap that reaches before the
start of t's document reads the document's carried-in inputs (the conv state of a
previous call, for decoding) or zero. It gives every token its neighbours before the
attention operator runs: what lets a linear recurrence match a key to the token after
it (docs/quality.md).

Every output is a gather from one buffer, per batch row:

    [ carried-in conv states (N x (W-1)) | local tokens (T) |
      gathered tails of every piece (sequence parallelism) | a zero row ]

with a [T, W] index table built once per call from global positions: a tap reads
the local token if this rank holds it, the halo (:mod:`hla_sp.parallel.halo`) if
another rank does, the carried state if it lies before the document's start, else zero.
The states sit just before the tokens so that, for one sequence per row (no documents,
one process), every tap is a contiguous slice of the buffer, and the taps together
are the depthwise convolution of the buffer (without its zero row, which only
documents and ranks read): one ``conv1d`` each way. A gather and its scatter-add
backward would cost most of a small layer's step on CPU, and W multiply-adds with
their autograd moved 4x the bytes.
The final conv state of each document (its last W-1 inputs) is assembled the same way
and, under sequence parallelism, summed over ranks (each rank adds the positions it
holds; rank 0 adds those carried in).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import maybe_get_fake_mode, unset_fake_temporarily

from hla_sp.parallel import exchange, halo
from hla_sp.parallel.plan import Plan
from hla_sp.parallel.summaries import SIGNATURE_WORDS, signature_words, verify_signatures


class _Layout:
    """Global positions and documents of this rank's tokens (single process: all)."""

    def __init__(self, T: int, bounds: list[int] | None, plan: Plan | None, device):
        self.plan, self.device = plan, device
        if plan is None:
            self.pieces = [(0, T, 0)]  # (global start, length, local offset)
        else:
            self.pieces = [(p.start, p.length, p.local_offset) for p in plan.own]
        total = T if plan is None else plan.T
        self.starts = [0] if bounds is None else list(bounds[:-1])
        self.ends = [total] if bounds is None else list(bounds[1:])
        self.pos = torch.cat([torch.arange(s, s + n) for s, n, _ in self.pieces]
                             or [torch.zeros(0, dtype=torch.long)])

    def rows(self, src: torch.Tensor, doc: torch.Tensor, T: int, halo_rows: int,
             W: int) -> torch.Tensor:
        """Buffer rows of global positions ``src`` read for documents ``doc`` (same shape)."""
        starts = torch.tensor(self.starts, dtype=torch.long)
        start = starts[doc]
        first = len(self.starts) * (W - 1)  # the row of local token 0
        out = torch.full_like(src, first + T + halo_rows)  # the zero row
        before = src < start
        # W-1 carried inputs per document (zeros without a state), the last one just
        # before its start.
        out = torch.where(before, doc * (W - 1) + (W - 1) - (start - src), out)
        todo = ~before
        for s, n, off in self.pieces:
            mine = todo & (src >= s) & (src < s + n)
            out = torch.where(mine, first + off + src - s, out)
            todo = todo & ~mine
        # Under torch.compile the table is graph ops, and the test would read it: where
        # nothing is left to do, the select is a no-op anyway.
        if self.plan is not None and (torch.compiler.is_compiling() or bool(todo.any())):
            out = torch.where(todo, first + T + halo.tail_rows(self.plan, src.clamp(min=0),
                                                               W - 1), out)
        return out


def _host() -> AbstractContextManager:
    """Where the host index tables are built: real tensors even under a FakeTensorMode
    (they come from Python ints, and a fake one could not be read back). Under
    torch.compile the tables are ops of the graph on constants instead (dynamo cannot
    enter this context manager; the compiled graph folds or recomputes them)."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return unset_fake_temporarily()


def _on(rows: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """A host index table where ``buf`` is: a fake tensor of buf's mode when buf is fake."""
    if torch.compiler.is_compiling():
        return rows.to(buf.device)
    mode = maybe_get_fake_mode(buf)
    return (rows if mode is None else mode.from_tensor(rows)).to(buf.device)


def _read(buf: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """buf [B, R, C] at ``rows`` [T] (host int64): a slice when the rows are consecutive,
    else a gather (always a gather under torch.compile: the test reads the table)."""
    T = rows.numel()
    if torch.compiler.is_compiling():
        return buf.index_select(1, _on(rows, buf))
    with _host():
        first = int(rows[0]) if T else 0
        consecutive = T > 0 and bool((rows == first + torch.arange(T)).all())
    if consecutive:
        return buf.narrow(1, first, T)
    return buf.index_select(1, _on(rows, buf))


def _gather_signed(plan: Plan, tails: torch.Tensor) -> torch.Tensor:
    """Every rank's tails [P, slots, B, W-1, C]. With the call's signature (a plan of
    :meth:`SequenceParallel.check_call` under check="auto"), one more slot carries it
    in the same all-gather, and every rank compares all ranks' words on the device
    before the call's next collective (hla_sp.parallel.engine explains why)."""
    sig = getattr(plan, "signature", None)
    if (sig is None or tails[:1].numel() < SIGNATURE_WORDS
            or tails.dtype not in (torch.float32, torch.float64)):  # 21-bit words: exact
        return halo.gather_tails(plan, tails)
    slot = tails.new_zeros(tails[:1].shape)
    slot.view(-1)[:SIGNATURE_WORDS] = signature_words(sig, tails.dtype)
    gathered = halo.gather_tails(plan, torch.cat([tails, slot]))
    P = gathered.shape[0]
    try:
        verify_signatures(gathered[:, -1].reshape(P, -1)[:, :SIGNATURE_WORDS])
    except RuntimeError:
        recheck = getattr(plan, "recheck", None)
        if recheck is not None:
            recheck()  # every rank is here: the full check says what differs
        raise
    return gathered[:, :-1]


class ShortConv(nn.Module):
    """Depthwise causal convolution with W taps and SiLU, per channel.

    The channels come in named groups (q, k and v), each its own parameter ``[local, W]``
    so that a tensor-parallel rank holds the rows of its heads, split along dim 0 like
    the projections. Initialisation draws every group's full ``[total, W]`` weight from
    the default generator and keeps this rank's rows: the same model whatever the
    tensor-parallel size (the draw does not depend on it).

    Args:
        groups: (name, local channels, total channels over ranks, offset of the local
            ones) per group, in the order the channels sit side by side.
        kernel_size: W >= 2 taps (the token itself and W-1 before it).
    """

    def __init__(self, groups: list[tuple[str, int, int, int]], kernel_size: int, *,
                 device=None, dtype=None):
        super().__init__()
        if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 2:
            raise ValueError(f"kernel_size: expected an int >= 2, got {kernel_size!r}")
        for name, local, total, offset in groups:
            if not 0 <= offset <= total - local:
                raise ValueError(f"groups: {name} expected 0 <= offset <= total - local, got "
                                 f"offset {offset}, local {local}, total {total}")
        self.groups, self.kernel_size = list(groups), kernel_size
        self.channels = sum(g[1] for g in groups)
        for name, local, _, _ in groups:
            # [:, d] multiplies x_{t-d}.
            self.register_parameter(name, nn.Parameter(
                torch.empty(local, kernel_size, device=device, dtype=dtype)))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """PyTorch's Conv1d initialisation for a depthwise kernel, U(-1/sqrt(W), 1/sqrt(W)),
        drawn for all ranks' channels and sliced to this rank's."""
        bound = self.kernel_size ** -0.5
        for name, local, total, offset in self.groups:
            full = torch.empty(total, self.kernel_size, dtype=torch.float32).uniform_(
                -bound, bound)
            getattr(self, name).copy_(full[offset : offset + local])

    @property
    def weight(self) -> torch.Tensor:
        """All groups' taps side by side, [C, W]."""
        return torch.cat([getattr(self, name) for name, *_ in self.groups])

    def forward(
        self,
        x: torch.Tensor,
        *,
        bounds: list[int] | None = None,
        state: torch.Tensor | None = None,
        want_final: bool = False,
        plan: Plan | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, T_local, C] -> (y [B, T_local, C], final conv state [N, W-1, C] or None).

        Args:
            bounds: global document offsets (cu_seqlens as ints, B == 1), or None (each
                batch row is one sequence).
            state: carried-in inputs [N, W-1, C] (N documents, or B rows), or None (zero).
            plan: the call's sequence-parallel plan, or None for one process.
        """
        B, T, C = x.shape
        W = self.kernel_size
        with _host():
            lay = _Layout(T, bounds, plan, x.device)
        N = len(lay.starts) if bounds is not None else B
        if state is not None and tuple(state.shape) != (N, W - 1, C):
            raise ValueError(f"initial_state: expected a conv state of shape {(N, W - 1, C)}, "
                             f"got {tuple(state.shape)}")
        # Carried-in states: per document for packed input (B == 1), per row otherwise.
        nstates = len(lay.starts) * (W - 1)
        if state is None:
            parts = [x.new_zeros(B, nstates, C)]
        elif bounds is not None:
            parts = [state.to(x.dtype).reshape(1, nstates, C)]
        else:
            parts = [state.to(x.dtype)]  # [B, W-1, C]: row b reads its own
        parts.append(x)
        if plan is not None:
            gathered = _gather_signed(plan, halo.own_tails(plan, x, W - 1))
            # [P, slots, B, W-1, C] -> [B, P * slots * (W-1), C], flattened as tail_index.
            parts.append(gathered.permute(2, 0, 1, 3, 4).reshape(B, -1, C))
        halo_rows = parts[-1].shape[1] if plan is not None else 0
        # one sequence per row (and some tokens: conv1d wants W rows at least)
        one_per_row = plan is None and bounds is None and T > 0
        if not one_per_row:  # what a tap before a document without a state reads
            parts.append(x.new_zeros(B, 1, C))
        buf = torch.cat(parts, dim=1)
        weight = self.weight.to(x.dtype)
        if one_per_row:
            # One sequence per row: tap d of token t is buffer row (W-1) + t - d (the
            # row's W-1 carried inputs sit just before its tokens), so the taps are the
            # depthwise convolution of the buffer's T + W - 1 rows: one kernel each way
            # (cuDNN, oneDNN) where W multiply-adds and their autograd moved 4x the
            # bytes (benchmarks/layer_traffic.py). In x's dtype, as the taps: autocast
            # would run conv1d in 16 bits. Made contiguous once here: q, k and v are
            # read by every stage of the operator, whose kernels want them so.
            dev = buf.device.type
            with (torch.autocast(dev, enabled=False) if torch.amp.is_autocast_available(dev)
                  else contextlib.nullcontext()):
                z = F.conv1d(buf.transpose(1, 2), weight.flip(1).unsqueeze(1), groups=C)
            y = F.silu(z).transpose(1, 2).contiguous()
        else:
            acc = None
            for tap, w in zip(self._tables(buf, lay, W, T, halo_rows), weight.unbind(1)):
                acc = tap * w if acc is None else torch.addcmul(acc, tap, w)
            y = F.silu(acc)
        final = None
        if want_final:
            final = self._final(buf, lay, W, T, halo_rows, N, B)
        if plan is not None:
            y = exchange.tie(y, plan)
        return y, final

    def _tables(self, buf: torch.Tensor, lay: _Layout, W: int, T: int,
                halo_rows: int) -> list[torch.Tensor]:
        """The W taps [B, T, C] read from ``buf`` through the [T, W] index table."""
        with _host():
            doc = torch.searchsorted(torch.tensor(lay.starts, dtype=torch.long), lay.pos,
                                     right=True) - 1
            src = lay.pos[:, None] - torch.arange(W)[None, :]  # [T, W]: tap d reads t - d
            index = lay.rows(src, doc[:, None].expand(-1, W), T, halo_rows, W)
        return [_read(buf, index[:, d]) for d in range(W)]

    def _final(self, buf: torch.Tensor, lay: _Layout, W: int, T: int, halo_rows: int,
               N: int, B: int) -> torch.Tensor:
        """Each document's last W-1 inputs: [N, W-1, C] (packed) or [B, W-1, C]. Under sp
        each rank adds the positions it holds, rank 0 those carried in (or zero), and one
        all-reduce sums them."""
        plan = lay.plan
        n_docs = len(lay.starts)
        with _host():
            starts = torch.tensor(lay.starts, dtype=torch.long)[:, None]
            src = (torch.tensor(lay.ends, dtype=torch.long)[:, None] - (W - 1)
                   + torch.arange(W - 1))
            doc = torch.arange(n_docs)[:, None].expand(-1, W - 1)
            before = src < starts
            held = torch.zeros_like(before)
            for s, n, _ in lay.pieces:
                held |= (src >= s) & (src < s + n)
            keep = held | (before & (plan is None or plan.rank == 0))
            # A position kept by another rank reads a harmless row here (one before the
            # document's start: its carried state or zero) and is left out.
            src = torch.where(keep, src, starts - 1)
            rows = lay.rows(src, doc, T, halo_rows, W).reshape(-1)
        rows, keep = _on(rows, buf), _on(keep.reshape(-1, 1), buf)
        # A select, not a product with the keep mask: what another rank holds is left out
        # even when the row read here holds a NaN (0 * NaN would be NaN, summed over ranks).
        if n_docs == 1 and N == B:  # one sequence per row
            final = torch.where(keep, buf.index_select(1, rows), 0.0)
        else:  # packed documents (B == 1)
            final = torch.where(keep, buf[0].index_select(0, rows), 0.0).view(
                N, W - 1, buf.shape[-1])
        if plan is not None:
            final = exchange.all_reduce(plan, final)
        return final

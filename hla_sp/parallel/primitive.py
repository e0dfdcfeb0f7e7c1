"""The primitive over shards: exact sequence parallelism by an inter-rank scan.

For each of this rank's pieces (one for contiguous, two for zigzag):

1. its summary (h, a, s) from a zero state: only the part after its last document
   start, with that document's initial state injected (cheap: one weighted K^T V);
2. the exchange of summaries starts (asynchronous; in backward, the reverse exchange
   runs while the backward of step 3 does);
3. meanwhile the zero-state outputs, by the single-process primitive with local
   resets at the global document starts inside the piece (the expensive part);
4. the carry into the piece (the fold of the earlier pieces' summaries) adds its
   term exp(A_t) q_t^T carry to the tokens before the piece's first document start;
5. each document's final state is computed where the document ends, and one
   all-reduce shares them.

Where the chunk scan is the torch one, steps 1, 3 and 4 are one chunk path cut in
three (:mod:`hla_sp.ops.chunk_split`): the summary is the zero-state scan the outputs
need anyway, step 3 computes the in-chunk terms, and step 4 the state terms with the
carry already in the states, so the sharded call does no arithmetic beyond the
single-process call's. Its backward mirrors that: d(carry) from dO first (the reverse
exchange starts), then the terms that need only dO, and after the reverse exchange the
terms through the states. The Triton kernels run steps 3 and 4 as written above.

Under torch.compile, steps 1-4 are one expression the compiler traces and
differentiates: the summaries, a functional all-gather and the fold
(:func:`hla_sp.parallel.exchange.traced_scan`), the zero-state outputs and the carry's
term; the compiler orders and overlaps the collective.

With ``overlap=False`` (a :class:`~hla_sp.parallel.SequenceParallel` option for
benchmarks) step 2 waits before step 3, in forward and in backward. The chunk algebra itself is
:mod:`hla_sp.ops.chunk` and :func:`hla_sp.ops.primitive.local_primitive`, never
re-implemented here.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hla_sp.ops.chunk import segment_summary, with_carry_terms
from hla_sp.ops.chunk_split import SplitChunks
from hla_sp.ops.dispatch import backend_for, compute_dtype
from hla_sp.ops.isolation import carry_into
from hla_sp.ops.primitive import local_primitive
from hla_sp.parallel import exchange
from hla_sp.parallel import summaries as S
from hla_sp.parallel.layouts import Piece
from hla_sp.parallel.plan import Plan

CARRY = -1  # a segment whose carry-in comes from the earlier pieces
Tensor = torch.Tensor
View = tuple[Tensor, Tensor, Tensor, "Tensor | None"]  # q, k, v, g of one piece


@dataclass(frozen=True)
class Segment:
    """A run of a piece between document starts, in local piece coordinates."""

    begin: int
    end: int
    doc: int  # global document index (0 .. N-1; 0 for the batch layout)
    source: int  # CARRY, or the document whose start opens the segment
    ends_doc: bool  # the document ends at this segment's end


def _count(xs: list[int], x: int, *, inclusive: bool) -> int:
    """How many of the sorted ``xs`` are < x (<= x when ``inclusive``): bisect, or a
    plain count under torch.compile, where the C bisect does not trace (at trace time
    only: the graph holds the result as a constant)."""
    if torch.compiler.is_compiling():
        return sum(1 for c in xs if c < x or (inclusive and c == x))
    return (bisect.bisect_right if inclusive else bisect.bisect_left)(xs, x)


def _segments(p: Piece, starts: list[int], ends: set[int]) -> list[Segment]:
    """Cut piece ``p`` at the global document starts inside it."""
    if p.length == 0:
        return []
    i0 = _count(starts, p.start, inclusive=False)
    inside = [(c - p.start, i) for i, c in enumerate(starts[i0:], start=i0) if c < p.end]
    cuts = [(0, CARRY)] if not inside or inside[0][0] > 0 else []
    cuts += inside
    lead_doc = _count(starts, p.start, inclusive=True) - 1
    segs = []
    for j, (b, src) in enumerate(cuts):
        e = cuts[j + 1][0] if j + 1 < len(cuts) else p.length
        doc = lead_doc if src == CARRY else src
        segs.append(Segment(b, e, doc, src, e < p.length or (p.start + e) in ends))
    return segs


def _part(x: Tensor | None, b: int, e: int) -> Tensor | None:
    return None if x is None else x[:, b:e]


@dataclass(frozen=True)
class _Call:
    """What the steps of one :func:`sp_primitive` call share."""

    plan: Plan
    shape: S.SummaryShape
    cdt: torch.dtype
    views: list[View]  # per own piece, in the compute dtype
    segs: list[list[Segment]]  # per own piece
    h0_of: Callable[[int], Tensor | None]  # a document's initial state, or None
    sig: Tensor | None  # the call's signature words, carried by every summary, or None


def sp_primitive(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    *,
    h0: Tensor | None,
    want_final: bool,
    chunk_size: int,
    plan: Plan,
) -> tuple[Tensor, Tensor | None]:
    """:func:`local_primitive` over the shards of a group, under a checked call's plan.

    Args:
        q: [B, T_local, H, K] this rank's shard, already scaled. k: [B, T_local, H, K].
        v: [B, T_local, H, V]. g: [B, T_local, H] log-decay or None.
        h0: GLOBAL initial states [N, H, K, V] (or [B, H, K, V]), or None.
        want_final: also return the global final states (on every rank).
        plan: what ``SequenceParallel.check_call`` returned for this call; it holds the
            global document offsets (B == 1), the pieces and the method.

    Returns:
        o [B, T_local, H, V] in q's dtype; final [N, H, K, V] (fp32, or fp64) or None.
    """
    B, _, H, K = q.shape
    cdt = compute_dtype(q.dtype)
    starts, ends = plan.starts, plan.ends

    # The batch layout has one "document" per batch row: h0 and finals are [B, ...].
    def h0_of(doc: int) -> Tensor | None:
        if h0 is None:
            return None
        return (h0 if plan.bounds is None else h0[doc : doc + 1]).to(cdt)

    qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)
    gc = None if g is None else g.to(cdt)
    views = []
    for p in plan.own:
        s, e = p.local_offset, p.local_offset + p.length
        views.append((qc[:, s:e], kc[:, s:e], vc[:, s:e], _part(gc, s, e)))
    # The call's signature rides in the summaries where every rank sees every piece
    # (the all-gather; hla_sp.parallel.engine explains the agreement design).
    sig = getattr(plan, "signature", None) if plan.method == "allgather" else None
    call = _Call(
        plan, S.SummaryShape(B, H, K, v.shape[-1], signed=sig is not None), cdt, views,
        [_segments(p, starts, ends) for p in plan.own], h0_of,
        None if sig is None else S.signature_words(sig, cdt),
    )
    if torch.compiler.is_compiling():
        # One expression the compiler traces and differentiates (it orders and overlaps
        # the collective itself): steps 1-4 without the split autograd Functions.
        Xs, last_state = _summaries(call, q.device)
        carries = exchange.traced_scan(plan, call.shape, Xs)
        outs = _zero_state_outputs(call, h0 is not None, chunk_size)
        carry_h = S.unpack(call.shape, carries)[0]
        o = _add_carries(call, outs, carry_h)
    else:
        o, last_state, carry_h = _eager_steps(call, q, k, v, g, h0 is not None, chunk_size)
    final = _final_states(call, last_state, carry_h, q.device) if want_final else None  # 5.
    if q.shape[1] == 0:
        # An empty shard's outputs read none of its inputs: tie them to the inputs (a sum
        # of nothing is an exact 0), so that their .grad is an empty tensor, not None.
        o = o + sum(x.sum() for x in (q, k, v, g) if x is not None) * 0
    return exchange.tie(o.to(q.dtype), plan), final


def _eager_steps(
    call: _Call, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, has_h0: bool,
    chunk_size: int,
) -> tuple[Tensor, list, Tensor]:
    """Steps 1-4 with the exchange in flight while the local outputs are computed.
    Returns o [B, T_local, H, V], each piece's last (h, a) and the carries' states."""
    plan = call.plan
    works = _split_works(call, chunk_size) if _use_split(q) else None
    Xs, last_state = _summaries(call, q.device, works)  # 1.
    ex, Xs = exchange.begin(plan, call.shape, Xs, (q, k, v, g))  # 2.
    carries = None
    if not plan.overlap:
        carries = exchange.scan(plan, call.shape, ex, Xs)
    if works is None:  # 3.
        outs = _zero_state_outputs(call, has_h0, chunk_size)
    else:
        for work in works:
            if work is not None:
                work.intra()
    if carries is None:
        carries = exchange.scan(plan, call.shape, ex, Xs)
    carry_h = S.unpack(call.shape, carries)[0]  # [n, B, H, K, V]
    if works is None:  # 4.
        o = _add_carries(call, outs, carry_h)
    else:
        o = _split_outputs(call, works, carries, carry_h, ex, has_h0)
    return o, last_state, carry_h


def _use_split(q: Tensor) -> bool:
    """Where the chunk scan is the torch one, each piece runs it split around the
    exchange (:mod:`hla_sp.ops.chunk_split`: no arithmetic beyond the single-process
    call's); the Triton kernels run as zero-state outputs plus the carry's term."""
    return backend_for(q) == "torch"


def _split_works(call: _Call, chunk_size: int) -> list[SplitChunks | None]:
    """Per own piece, its chunk path in steps (None for an empty piece), with resets
    at the document starts inside it."""
    works: list[SplitChunks | None] = []
    for (qp, kp, vp, gp), sg in zip(call.views, call.segs):
        if not sg:
            works.append(None)
            continue
        resets = None
        if len(sg) > 1:
            resets = torch.zeros(qp.shape[0], qp.shape[1], dtype=torch.bool, device=qp.device)
            resets[:, [x.begin for x in sg[1:]]] = True
        detached = (x.detach() if x is not None else None for x in (qp, kp, vp, gp))
        works.append(SplitChunks(*detached, resets, chunk_size))
    return works


class _SplitSummary(torch.autograd.Function):
    """(q, k, v, g) of a piece -> the zero-state state after it, [B, H, K, V] (step 1).
    Its backward, which runs after the reverse exchange, completes the piece's whole
    local backward with the summary's gradient (:meth:`SplitChunks.finish`)."""

    @staticmethod
    def forward(ctx, q, k, v, g, work):  # type: ignore[override]
        ctx.work = work
        return work.summary()

    @staticmethod
    def backward(ctx, dS):  # type: ignore[override]
        dq, dk, dv, dg = ctx.work.finish(dS)
        ctx.work = None
        return dq, dk, dv, dg, None


class _SplitOutputs(torch.autograd.Function):
    """(q, k, v, g, h_init, carries) -> the piece's outputs with h_init carried in (step
    4). Its backward returns d h_init at once, for the reverse exchange, and leaves the
    terms that need only dO to run while that exchange travels (without overlap, at
    once). ``carries`` is an input only so that this backward runs before the scan's."""

    @staticmethod
    def forward(ctx, q, k, v, g, h_init, carries, work, ex, overlap):  # type: ignore[override]
        ctx.work, ctx.ex, ctx.overlap = work, ex, overlap
        ctx.has_init = h_init is not None
        ctx.save_for_backward(h_init)
        return work.outputs(h_init)

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        (h_init,) = ctx.saved_tensors
        work = ctx.work
        d_init = work.carry_grad(do)
        if ctx.overlap:
            ctx.ex.during_reverse.append(lambda: work.local(h_init))
        else:
            work.local(h_init)
        ctx.work = ctx.ex = None
        return None, None, None, None, d_init if ctx.has_init else None, None, None, None, None


def _split_outputs(
    call: _Call, works: list[SplitChunks | None], carries: Tensor, carry_h: Tensor,
    ex: exchange.Exchange, has_h0: bool,
) -> Tensor:
    """Step 4 on the split path: each piece's outputs with its carry-in (the carry, or
    its first document's h0), then the h0 of the documents starting inside it."""
    B, H, V = call.shape.B, call.shape.H, call.shape.V
    outs = []
    for j, (work, (qp, kp, vp, gp), sg) in enumerate(zip(works, call.views, call.segs)):
        if work is None:
            outs.append(qp.new_zeros(B, 0, H, V))
            continue
        first = sg[0]
        h_init = carry_h[j] if first.source == CARRY else call.h0_of(first.source)
        o = _SplitOutputs.apply(qp, kp, vp, gp, h_init, carries, work, ex, call.plan.overlap)
        if has_h0:  # the documents starting inside the piece
            o = with_carry_terms(o, qp, gp, [(x.begin, x.end, call.h0_of(x.source))
                                             for x in sg[1:]])
        outs.append(o)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _summaries(
    call: _Call, device: torch.device, works: list[SplitChunks | None] | None = None
) -> tuple[Tensor, list[tuple[Tensor, Tensor] | None]]:
    """Step 1: each piece's summary, its last segment's zero-state state with that
    document's h0 injected. Returns X [n_own, D] and each last segment's (h, a)."""
    shape, cdt = call.shape, call.cdt
    X, last_state = [], []
    for j, ((qp, kp, vp, gp), sg) in enumerate(zip(call.views, call.segs)):
        if not sg:
            X.append(S.signed_identity(shape, cdt, device, call.sig))
            last_state.append(None)
            continue
        last = sg[-1]
        if works is None:
            h, a = segment_summary(
                kp[:, last.begin :], vp[:, last.begin :], _part(gp, last.begin, last.end)
            )
        else:
            # the split path's zero-state state after the piece is its last segment's
            h = _SplitSummary.apply(qp, kp, vp, gp, works[j])
            a = (gp[:, last.begin :].sum(1) if gp is not None
                 else torch.zeros(shape.B, shape.H, dtype=cdt, device=device))
        last_state.append((h, a))
        start = last.source != CARRY
        h0d = call.h0_of(last.source) if start else None
        if h0d is not None:
            h = carry_into(h, a, h0d)
        a_tot = a if last.begin == 0 else (gp.sum(1) if gp is not None else torch.zeros_like(a))
        X.append(S.pack(shape, h, a_tot, start, call.sig))
    Xs = torch.stack(X) if X else torch.zeros(0, shape.size, dtype=cdt, device=device)
    return Xs, last_state


def _zero_state_outputs(call: _Call, has_h0: bool, chunk_size: int) -> list[Tensor]:
    """Step 3: each piece's outputs with local resets at the document starts inside it;
    the carried-in part of h0 is added once the carry is known (step 4)."""
    B, H, K, V = call.shape.B, call.shape.H, call.shape.K, call.shape.V
    outs = []
    for (qp, kp, vp, gp), sg in zip(call.views, call.segs):
        if not sg:
            outs.append(qp.new_zeros(B, 0, H, V))
            continue
        local_cu = None
        if len(sg) > 1:
            local_cu = (sg[0].begin, *(x.end for x in sg))  # Python ints: no host read
        local_h0 = None
        if has_h0:
            zero = qp.new_zeros(B, H, K, V)
            parts = [call.h0_of(x.source) if x.source != CARRY else zero for x in sg]
            local_h0 = torch.cat(parts) if call.plan.bounds is not None else parts[0]
        o, _ = local_primitive(
            qp, kp, vp, gp, bounds=local_cu, h0=local_h0, chunk_size=chunk_size
        )
        outs.append(o)
    return outs


def _add_carries(call: _Call, outs: list[Tensor], carry_h: Tensor) -> Tensor:
    """Step 4: the carry's term on the tokens before each piece's first document start."""
    for j, ((qp, _, _, gp), sg) in enumerate(zip(call.views, call.segs)):
        if sg and sg[0].source == CARRY:
            outs[j] = with_carry_terms(outs[j], qp, gp, [(0, sg[0].end, carry_h[j])])
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _final_states(
    call: _Call, last_state: list, carry_h: Tensor, device: torch.device
) -> Tensor:
    """Step 5: each document's final state where it ends, shared by one all-reduce."""
    B, H, K, V = call.shape.B, call.shape.H, call.shape.K, call.shape.V
    rows: dict[int, Tensor] = {}
    for j, ((_, kp, vp, gp), sg) in enumerate(zip(call.views, call.segs)):
        for x in sg:
            if not x.ends_doc:
                continue
            if x is sg[-1]:
                h, a = last_state[j]
            else:
                h, a = segment_summary(
                    kp[:, x.begin : x.end], vp[:, x.begin : x.end], _part(gp, x.begin, x.end)
                )
            c = carry_h[j] if x.source == CARRY else call.h0_of(x.source)
            h = carry_into(h, a, c)  # a hard reset cuts c, even a NaN one
            rows[x.doc] = h
    if call.plan.bounds is None:
        mine = rows.get(0, torch.zeros(B, H, K, V, dtype=call.cdt, device=device))
    else:
        zero = torch.zeros(1, H, K, V, dtype=call.cdt, device=device)
        mine = torch.cat([rows.get(i, zero) for i in range(len(call.plan.starts))])
    return exchange.all_reduce(call.plan, mine)

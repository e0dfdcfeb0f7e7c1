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

With ``overlap=False`` (a :class:`~hla_sp.parallel.SequenceParallel` option for
benchmarks) step 2 waits before step 3, in forward and in backward. The chunk algebra itself is
:mod:`hla_sp.ops.chunk` and :func:`hla_sp.ops.linear_attention.local_primitive`, never
re-implemented here.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hla_sp.ops.chunk import carry_term, segment_summary
from hla_sp.ops.linear_attention import local_primitive
from hla_sp.ops.precision import compute_dtype
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


def _segments(p: Piece, starts: list[int], ends: set[int]) -> list[Segment]:
    """Cut piece ``p`` at the global document starts inside it."""
    if p.length == 0:
        return []
    i0 = bisect.bisect_left(starts, p.start)
    inside = [(c - p.start, i) for i, c in enumerate(starts[i0:], start=i0) if c < p.end]
    cuts = [(0, CARRY)] if not inside or inside[0][0] > 0 else []
    cuts += inside
    lead_doc = bisect.bisect_right(starts, p.start) - 1
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
    call = _Call(
        plan, S.SummaryShape(B, H, K, v.shape[-1]), cdt, views,
        [_segments(p, starts, ends) for p in plan.own], h0_of,
    )
    Xs, last_state = _summaries(call, q.device)  # 1.
    ex, Xs = exchange.begin(plan, call.shape, Xs, (q, k, v, g))  # 2.
    carries = None
    if not plan.overlap:
        carries = exchange.scan(plan, call.shape, ex, Xs)
    outs = _zero_state_outputs(call, h0 is not None, chunk_size)  # 3.
    if carries is None:
        carries = exchange.scan(plan, call.shape, ex, Xs)
    carry_h = S.unpack(call.shape, carries)[0]  # [n, B, H, K, V]
    o = _add_carries(call, outs, carry_h)  # 4.
    final = _final_states(call, last_state, carry_h, q.device) if want_final else None  # 5.
    return exchange.tie(o.to(q.dtype), plan), final


def _summaries(
    call: _Call, device: torch.device
) -> tuple[Tensor, list[tuple[Tensor, Tensor] | None]]:
    """Step 1: each piece's summary, its last segment's zero-state state with that
    document's h0 injected. Returns X [n_own, D] and each last segment's (h, a)."""
    shape, cdt = call.shape, call.cdt
    X, last_state = [], []
    for (_, kp, vp, gp), sg in zip(call.views, call.segs):
        if not sg:
            X.append(S.identity(shape, cdt, device))
            last_state.append(None)
            continue
        last = sg[-1]
        h, a = segment_summary(
            kp[:, last.begin :], vp[:, last.begin :], _part(gp, last.begin, last.end)
        )
        last_state.append((h, a))
        start = last.source != CARRY
        h0d = call.h0_of(last.source) if start else None
        if h0d is not None:
            h = h + torch.exp(a)[..., None, None] * h0d
        a_tot = a if last.begin == 0 else (gp.sum(1) if gp is not None else torch.zeros_like(a))
        X.append(S.pack(shape, h, a_tot, start))
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
            local_cu = torch.tensor([sg[0].begin] + [x.end for x in sg], dtype=torch.int64)
        local_h0 = None
        if has_h0:
            zero = qp.new_zeros(B, H, K, V)
            parts = [call.h0_of(x.source) if x.source != CARRY else zero for x in sg]
            local_h0 = torch.cat(parts) if call.plan.bounds is not None else parts[0]
        o, _ = local_primitive(
            qp, kp, vp, gp, cu_seqlens=local_cu, h0=local_h0, chunk_size=chunk_size
        )
        outs.append(o)
    return outs


def _add_carries(call: _Call, outs: list[Tensor], carry_h: Tensor) -> Tensor:
    """Step 4: the carry's term on the tokens before each piece's first document start."""
    for j, ((qp, _, _, gp), sg) in enumerate(zip(call.views, call.segs)):
        if sg and sg[0].source == CARRY:
            lead = sg[0].end
            term = carry_term(qp[:, :lead], _part(gp, 0, lead), carry_h[j])
            outs[j] = torch.cat([outs[j][:, :lead] + term, outs[j][:, lead:]], dim=1)
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
            if c is not None:
                h = h + torch.exp(a)[..., None, None] * c
            rows[x.doc] = h
    if call.plan.bounds is None:
        mine = rows.get(0, torch.zeros(B, H, K, V, dtype=call.cdt, device=device))
    else:
        zero = torch.zeros(1, H, K, V, dtype=call.cdt, device=device)
        mine = torch.cat([rows.get(i, zero) for i in range(len(call.plan.starts))])
    return exchange.all_reduce(call.plan, mine)

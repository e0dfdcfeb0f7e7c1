"""The primitive over shards: exact sequence parallelism by an inter-rank scan.

For each of this rank's pieces (one for contiguous, two for zigzag):

1. its summary (h, a, s) from a zero state: only the part after its last document
   start, with that document's initial state injected (cheap: one weighted K^T V);
2. the exchange of summaries starts (asynchronous);
3. meanwhile the zero-state outputs, by the single-process primitive with local
   resets at the global document starts inside the piece (the expensive part);
4. the carry into the piece (the fold of the earlier pieces' summaries) adds its
   term exp(A_t) q_t^T carry to the tokens before the piece's first document start;
5. each document's final state is computed where the document ends, and one
   all-reduce shares them.

The chunk algebra itself is :mod:`hla_sp.ops.chunk` and
:func:`hla_sp.ops.linear_attention.local_primitive`, never re-implemented here.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hla_sp.ops.chunk import carry_term, compute_dtype, segment_summary
from hla_sp.ops.linear_attention import local_primitive
from hla_sp.parallel import exchange
from hla_sp.parallel import summaries as S
from hla_sp.parallel.layouts import Piece

if TYPE_CHECKING:
    from hla_sp.parallel.config import SequenceParallel

CARRY = -1  # a segment whose carry-in comes from the earlier pieces
# Benchmark knob: False waits for the exchange before computing the local outputs,
# which measures how much of the exchange the overlap hides. Always True in use.
OVERLAP = True


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


def _part(x: torch.Tensor | None, b: int, e: int) -> torch.Tensor | None:
    return None if x is None else x[:, b:e]


def sp_primitive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    *,
    cu_seqlens: torch.Tensor | None,
    h0: torch.Tensor | None,
    want_final: bool,
    chunk_size: int,
    sp: SequenceParallel,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`local_primitive` over the shards of a group.

    Args:
        q: [B, T_local, H, K] this rank's shard, already scaled. k: [B, T_local, H, K].
        v: [B, T_local, H, V]. g: [B, T_local, H] log-decay or None.
        cu_seqlens: GLOBAL document offsets, int64 CPU [N + 1] (B == 1), or None.
        h0: GLOBAL initial states [N, H, K, V] (or [B, H, K, V]), or None.
        want_final: also return the global final states (on every rank).
        sp: the :class:`SequenceParallel` whose ``check_call`` ran for this call.

    Returns:
        o [B, T_local, H, V] in q's dtype; final [N, H, K, V] (fp32, or fp64) or None.
    """
    plan = sp.plan_for(q, cu_seqlens)
    B, _, H, K = q.shape
    V = v.shape[-1]
    cdt = compute_dtype(q.dtype)
    shape = S.SummaryShape(B, H, K, V)
    if cu_seqlens is None:
        starts, ends = [0], {plan.T}
    else:
        bounds = cu_seqlens.tolist()
        starts, ends = bounds[:-1], set(bounds[1:])
    # The batch layout has one "document" per batch row: h0 and finals are [B, ...].
    def h0_of(doc: int) -> torch.Tensor | None:
        if h0 is None:
            return None
        return (h0 if cu_seqlens is None else h0[doc : doc + 1]).to(cdt)

    own = plan.own
    qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)
    gc = None if g is None else g.to(cdt)
    views = []
    for p in own:
        s, e = p.local_offset, p.local_offset + p.length
        views.append((qc[:, s:e], kc[:, s:e], vc[:, s:e], _part(gc, s, e)))
    segs = [_segments(p, starts, ends) for p in own]

    # 1. Summaries: the last segment's zero-state state, its document's h0 injected.
    X, last_state = [], []
    for (_, kp, vp, gp), sg in zip(views, segs):
        if not sg:
            X.append(S.identity(shape, cdt, q.device))
            last_state.append(None)
            continue
        last = sg[-1]
        h, a = segment_summary(
            kp[:, last.begin :], vp[:, last.begin :], _part(gp, last.begin, last.end)
        )
        last_state.append((h, a))
        start = last.source != CARRY
        h0d = h0_of(last.source) if start else None
        if h0d is not None:
            h = h + torch.exp(a)[..., None, None] * h0d
        a_tot = a if last.begin == 0 else (gp.sum(1) if gp is not None else torch.zeros_like(a))
        X.append(S.pack(shape, h, a_tot, start))
    Xs = torch.stack(X) if X else torch.zeros(0, shape.size, dtype=cdt, device=q.device)

    # 2. The exchange starts ...
    pending = exchange.start(sp.method, plan, shape, Xs.detach())
    carries = None
    if not OVERLAP:
        carries = exchange.scan(plan, shape, sp.method, Xs, pending, (q, k, v, g))

    # 3. ... while the zero-state outputs are computed.
    outs = []
    for (qp, kp, vp, gp), sg in zip(views, segs):
        if not sg:
            outs.append(qp.new_zeros(B, 0, H, V))
            continue
        local_cu = None
        if len(sg) > 1:
            local_cu = torch.tensor([sg[0].begin] + [x.end for x in sg], dtype=torch.int64)
        local_h0 = None
        if h0 is not None:
            # The carried-in part is added once the carry is known (step 4).
            zero = qp.new_zeros(B, H, K, V)
            parts = [h0_of(x.source) if x.source != CARRY else zero for x in sg]
            local_h0 = torch.cat(parts) if cu_seqlens is not None else parts[0]
        o, _ = local_primitive(
            qp, kp, vp, gp, cu_seqlens=local_cu, h0=local_h0, chunk_size=chunk_size
        )
        outs.append(o)

    # 4. Carries: add their terms to the tokens before each piece's first start.
    if carries is None:
        carries = exchange.scan(plan, shape, sp.method, Xs, pending, (q, k, v, g))
    carry_h = S.unpack(shape, carries)[0]  # [n, B, H, K, V]
    for j, ((qp, _, _, gp), sg) in enumerate(zip(views, segs)):
        if sg and sg[0].source == CARRY:
            lead = sg[0].end
            term = carry_term(qp[:, :lead], _part(gp, 0, lead), carry_h[j])
            outs[j] = torch.cat([outs[j][:, :lead] + term, outs[j][:, lead:]], dim=1)
    o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    # 5. Final states, each where its document ends, shared by one all-reduce.
    final = None
    if want_final:
        n_doc = B if cu_seqlens is None else len(starts)
        rows: dict[int, torch.Tensor] = {}
        for j, ((_, kp, vp, gp), sg) in enumerate(zip(views, segs)):
            for x in sg:
                if not x.ends_doc:
                    continue
                if x is sg[-1]:
                    h, a = last_state[j]
                else:
                    h, a = segment_summary(
                        kp[:, x.begin : x.end], vp[:, x.begin : x.end], _part(gp, x.begin, x.end)
                    )
                c = carry_h[j] if x.source == CARRY else h0_of(x.source)
                if c is not None:
                    h = h + torch.exp(a)[..., None, None] * c
                rows[x.doc] = h
        if cu_seqlens is None:
            mine = rows.get(0, torch.zeros(B, H, K, V, dtype=cdt, device=q.device))
        else:
            zero = torch.zeros(1, H, K, V, dtype=cdt, device=q.device)
            mine = torch.cat([rows.get(i, zero) for i in range(n_doc)])
        final = exchange.all_reduce(plan, mine)
    return exchange.tie(o.to(q.dtype), plan), final

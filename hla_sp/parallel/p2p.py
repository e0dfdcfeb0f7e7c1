"""Point-to-point exchanges of summaries: the ring and the tree, forward and backward.

- ring: the carry travels piece to piece (P-1 hops for contiguous); backward: d(carry)
  travels back the same way;
- tree: a Hillis-Steele scan, ceil(log2 M) rounds of point-to-point messages;
  backward: the rounds in reverse.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hla_sp.parallel import summaries as S
from hla_sp.parallel.comm import count, size_bytes
from hla_sp.parallel.plan import Plan


class _P2P:
    """Batched isend/irecv between group ranks, with byte accounting."""

    def __init__(self, plan: Plan, category: str):
        self.plan, self.category = plan, category
        self.works: list[Any] = []

    def send(self, x: torch.Tensor, to: int, tag: int) -> None:
        x = x.contiguous()
        self.works.append(dist.isend(x, self.plan.global_rank(to), group=self.plan.group, tag=tag))
        count(self.category, size_bytes(x))

    def recv(self, like: torch.Tensor, frm: int, tag: int) -> torch.Tensor:
        buf = torch.empty_like(like)
        dist.recv(buf, self.plan.global_rank(frm), group=self.plan.group, tag=tag)
        return buf

    def irecv(self, like: torch.Tensor, frm: int, tag: int) -> torch.Tensor:
        buf = torch.empty_like(like)
        src = self.plan.global_rank(frm)
        self.works.append(dist.irecv(buf, src, group=self.plan.group, tag=tag))
        return buf

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works = []


def ring_forward(plan: Plan, shape: S.SummaryShape, X: torch.Tensor) -> torch.Tensor:
    """The carry [n_own, D] into each own piece (slot order); the running prefix hops
    from piece m to m + 1."""
    M, me = len(plan.pieces), plan.rank
    own = sorted(plan.own, key=lambda p: p.m)
    p2p = _P2P(plan, "summary")
    local: dict[int, torch.Tensor] = {}
    carries: dict[int, torch.Tensor] = {}
    ident = S.identity(shape, X.dtype, X.device)
    for p in own:
        if p.m == 0:
            c = ident
        elif plan.pieces[p.m - 1].owner == me:
            c = local.pop(p.m)
        else:
            c = p2p.recv(ident, plan.pieces[p.m - 1].owner, tag=p.m)
        carries[p.slot] = c
        if p.m + 1 < M:
            nxt = S.combine(shape, c, X[p.slot])
            nowner = plan.pieces[p.m + 1].owner
            if nowner == me:
                local[p.m + 1] = nxt
            else:
                p2p.send(nxt, nowner, tag=p.m + 1)
    p2p.wait()
    return torch.stack([carries[p.slot] for p in plan.own]) if own else X.new_zeros(0, shape.size)


def ring_backward(
    plan: Plan, shape: S.SummaryShape, X: torch.Tensor, carries: torch.Tensor, d: torch.Tensor
) -> torch.Tensor:
    """Mirror of :func:`ring_forward`: d(prefix) hops from piece m + 1 back to m."""
    M, me = len(plan.pieces), plan.rank
    p2p = _P2P(plan, "summary_grad")
    local: dict[int, torch.Tensor] = {}
    dX = torch.zeros_like(X)
    for p in sorted(plan.own, key=lambda p: p.m, reverse=True):
        if p.m + 1 < M:
            nowner = plan.pieces[p.m + 1].owner
            if nowner == me:
                d_next = local.pop(p.m + 1)
            else:
                d_next = p2p.recv(X[p.slot], nowner, tag=M + p.m + 1)
            dc, dX[p.slot] = S.combine_vjp(shape, carries[p.slot], X[p.slot], d_next)
            dc = dc + d[p.slot]
        else:
            dc = d[p.slot]
        if p.m > 0:
            powner = plan.pieces[p.m - 1].owner
            if powner == me:
                local[p.m] = dc
            else:
                p2p.send(dc, powner, tag=M + p.m)
    p2p.wait()
    return dX


def tree_forward(
    plan: Plan, shape: S.SummaryShape, X: torch.Tensor
) -> tuple[torch.Tensor, list[dict[int, tuple]]]:
    """Hillis-Steele exclusive scan over the M pieces: round d joins distance 2^d.
    Returns the carries [n_own, D] (slot order) and each round's operands, which
    :func:`tree_backward` takes."""
    M = len(plan.pieces)
    own = plan.own
    ident = S.identity(shape, X.dtype, X.device)
    inc = {p.m: X[p.slot] for p in own}  # inclusive prefix over the current window
    exc = {p.m: ident for p in own}  # exclusive prefix over the current window
    saved: list[dict[int, tuple]] = []
    step, rnd = 1, 0
    while step < M:
        p2p = _P2P(plan, "summary")
        got: dict[int, torch.Tensor] = {}
        for p in own:
            if p.m + step < M:
                dst = plan.pieces[p.m + step]
                if dst.owner == plan.rank:
                    got[dst.m] = inc[p.m]
                else:
                    p2p.send(inc[p.m], dst.owner, tag=rnd * M + dst.m)
            if p.m - step >= 0 and plan.pieces[p.m - step].owner != plan.rank:
                got[p.m] = p2p.irecv(ident, plan.pieces[p.m - step].owner, tag=rnd * M + p.m)
        p2p.wait()
        this: dict[int, tuple] = {}
        for p in own:
            if p.m - step >= 0:
                R = got[p.m]
                this[p.m] = (R, exc[p.m], inc[p.m])
                exc[p.m] = S.combine(shape, R, exc[p.m])
                inc[p.m] = S.combine(shape, R, inc[p.m])
        saved.append(this)
        step, rnd = step * 2, rnd + 1
    out = torch.stack([exc[p.m] for p in own]) if own else X.new_zeros(0, shape.size)
    return out, saved


def tree_backward(
    plan: Plan, shape: S.SummaryShape, X: torch.Tensor, saved: list, d: torch.Tensor
) -> torch.Tensor:
    """The rounds of :func:`tree_forward` in reverse, each ⊕ by its vector-Jacobian product."""
    M = len(plan.pieces)
    own = plan.own
    d_exc = {p.m: d[p.slot] for p in own}
    d_inc = {p.m: torch.zeros_like(X[p.slot]) for p in own}
    for rnd in reversed(range(len(saved))):
        step = 1 << rnd
        p2p = _P2P(plan, "summary_grad")
        back: dict[int, torch.Tensor] = {}  # grads for the values sent this round
        for p in own:
            if p.m - step >= 0:
                R, e_prev, i_prev = saved[rnd][p.m]
                dR_e, d_exc[p.m] = S.combine_vjp(shape, R, e_prev, d_exc[p.m])
                dR_i, d_inc[p.m] = S.combine_vjp(shape, R, i_prev, d_inc[p.m])
                src = plan.pieces[p.m - step]
                if src.owner == plan.rank:
                    back[src.m] = dR_e + dR_i
                else:
                    p2p.send(dR_e + dR_i, src.owner, tag=(len(saved) + rnd) * M + src.m)
        for p in own:
            if p.m + step < M:
                dst = plan.pieces[p.m + step]
                if dst.owner != plan.rank:
                    back[p.m] = p2p.irecv(X[p.slot], dst.owner, tag=(len(saved) + rnd) * M + p.m)
        p2p.wait()
        for m, g in back.items():
            d_inc[m] = d_inc[m] + g
    dX = torch.zeros_like(X)
    for p in own:
        dX[p.slot] = d_inc[p.m]
    return dX

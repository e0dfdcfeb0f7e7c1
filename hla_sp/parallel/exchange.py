"""The exchange of segment summaries between ranks, forward and backward.

Three methods compute the same exclusive scan (the carry into each of this rank's
pieces) over the pieces in global order:

- ``allgather``: one all-gather of every rank's summaries, then a local fold;
  backward: the local fold's vector-Jacobian product, then one reduce-scatter;
- ``ring``: the carry travels piece to piece (P-1 hops for contiguous);
  backward: d(carry) travels back the same way;
- ``tree``: a Hillis-Steele scan, ceil(log2 M) rounds of point-to-point messages;
  backward: the rounds in reverse.

Each is one ``torch.autograd.Function`` whose backward ALWAYS runs its collective on
every rank, rank 0 included (whose carry depends on no other rank). Two things make
that true whatever each rank's graph looks like:

- a *token*: every collective of a call takes the previous collective's token and
  returns a new one, and the call's output is tied to the last token, so in backward
  every rank reaches every collective, in the reverse of the forward order;
- the first collective of a primitive stage also takes q, k, v, g as inputs (with
  no gradient), so a later call's collectives always run before an earlier call's,
  even on a rank whose shard is empty.

The exchange starts before the expensive local outputs are computed: the all-gather
as an asynchronous collective, ring and tree on a helper thread. Bytes sent by this
rank are counted per category (see :func:`traffic`), as the bandwidth-optimal ring
algorithm of each collective sends them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hla_sp.parallel import summaries as S

if TYPE_CHECKING:
    from hla_sp.parallel.config import Plan

_TRAFFIC: dict[str, int] = {}
_BLOCKED = [0.0]  # seconds the calling thread waited for forward exchanges to finish
_LOCK = threading.Lock()


def count(category: str, nbytes: int) -> None:
    """Add ``nbytes`` sent by this rank to ``category``."""
    with _LOCK:
        _TRAFFIC[category] = _TRAFFIC.get(category, 0) + int(nbytes)


def traffic() -> dict[str, int]:
    """Bytes sent by this rank since the last reset, per category and in ``total``.

    Categories: ``summary`` (forward exchange), ``summary_grad`` (its backward),
    ``final`` / ``final_grad`` (final states), ``meta`` (the per-call agreement check).
    """
    with _LOCK:
        out = dict(_TRAFFIC)
    out["total"] = sum(out.values())
    return out


def reset_traffic() -> None:
    """Zero every counter (bytes and blocked time)."""
    with _LOCK:
        _TRAFFIC.clear()
        _BLOCKED[0] = 0.0


def blocked_seconds() -> float:
    """Seconds this rank's calling thread has waited for forward exchanges since the
    last reset: what the overlap did not hide (includes waiting for slower ranks)."""
    return _BLOCKED[0]


# torch >= 2.10 renamed the tensor forms of the two collectives; keep older torch working.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


# ----------------------------------------------------------------------------- pending


class Pending:
    """An exchange in flight; :meth:`wait` returns its result."""

    def __init__(self, wait: Callable[[], Any]):
        self._wait = wait

    def wait(self) -> Any:
        t = time.perf_counter()
        try:
            return self._wait()
        finally:
            _BLOCKED[0] += time.perf_counter() - t


def _on_thread(fn: Callable[[], Any]) -> Pending:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:  # re-raised on the calling thread
            box["err"] = e

    t = threading.Thread(target=run, name="hla_sp-exchange", daemon=True)
    t.start()

    def wait() -> Any:
        t.join()
        if "err" in box:
            raise box["err"]
        return box["out"]

    return Pending(wait)


def start(method: str, plan: Plan, shape: S.SummaryShape, X: torch.Tensor) -> Pending:
    """Start exchanging this rank's summaries X [n_own, D] (detached)."""
    if method == "allgather":
        P = plan.world_size
        flat = X.reshape(-1).contiguous()
        if P == 1:
            return Pending(lambda: flat.view(1, *X.shape))
        out = flat.new_empty(P * flat.numel())
        work = all_gather_single(out, flat, group=plan.group, async_op=True)
        count("summary", (P - 1) * _nbytes(flat))

        def wait() -> torch.Tensor:
            work.wait()
            return out.view(P, *X.shape)

        return Pending(wait)
    if method == "ring":
        return _on_thread(lambda: _ring_forward(plan, shape, X))
    if method == "tree":
        return _on_thread(lambda: _tree_forward(plan, shape, X))
    raise ValueError(f"method: expected allgather, ring or tree, got {method!r}")


# ---------------------------------------------------------------------- point to point


class _P2P:
    """Batched isend/irecv between group ranks, with byte accounting."""

    def __init__(self, plan: Plan, category: str):
        self.plan, self.category = plan, category
        self.works: list[Any] = []

    def send(self, x: torch.Tensor, to: int, tag: int) -> None:
        x = x.contiguous()
        self.works.append(dist.isend(x, self.plan.global_rank(to), group=self.plan.group, tag=tag))
        count(self.category, _nbytes(x))

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


def _ring_forward(plan: Plan, shape: S.SummaryShape, X: torch.Tensor) -> tuple:
    """Carry into each own piece; the running prefix hops from piece m to m + 1."""
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
    out = torch.stack([carries[p.slot] for p in plan.own]) if own else X.new_zeros(0, shape.size)
    return out, out


def _ring_backward(
    plan: Plan, shape: S.SummaryShape, X: torch.Tensor, carries: torch.Tensor, d: torch.Tensor
) -> torch.Tensor:
    """Mirror of :func:`_ring_forward`: d(prefix) hops from piece m + 1 back to m."""
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


def _tree_forward(plan: Plan, shape: S.SummaryShape, X: torch.Tensor) -> tuple:
    """Hillis-Steele exclusive scan over the M pieces: round d joins distance 2^d."""
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


def _tree_backward(
    plan: Plan, shape: S.SummaryShape, X: torch.Tensor, saved: list, d: torch.Tensor
) -> torch.Tensor:
    """The rounds of :func:`_tree_forward` in reverse, each ⊕ by its vector-Jacobian product."""
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


# -------------------------------------------------------------------- autograd wrappers


def _global_order(plan: Plan, gathered: torch.Tensor) -> torch.Tensor:
    """[P, n, D] gathered by rank -> [M, D] in global piece order."""
    return torch.stack([gathered[p.owner, p.slot] for p in plan.pieces])


class _Scan(torch.autograd.Function):
    """(token, X [n, D], q, k, v, g) -> (token, carries [n, D]); collective both ways."""

    @staticmethod
    def forward(ctx, token, X, q, k, v, g, pending, plan, shape, method):
        ctx.plan, ctx.shape, ctx.method = plan.for_backward(), shape, method
        if method == "allgather":
            gathered = pending.wait()
            carries = S.exclusive_prefixes(
                shape, _global_order(plan, gathered), [p.m for p in plan.own]
            )
            ctx.save_for_backward(X, gathered)
        else:
            carries, saved = pending.wait()
            ctx.saved_scan = saved
            ctx.save_for_backward(X, carries)
        return token.new_zeros(()), carries.detach().clone()

    @staticmethod
    def backward(ctx, d_token, d_carries):
        plan, shape = ctx.plan, ctx.shape
        X, aux = ctx.saved_tensors
        if d_carries is None:
            d_carries = torch.zeros(len(plan.own), shape.size, dtype=X.dtype, device=X.device)
        d_carries = d_carries.to(X.dtype)
        if ctx.method == "allgather":
            dX = _allgather_backward(plan, shape, X, aux, d_carries)
        elif ctx.method == "ring":
            dX = _ring_backward(plan, shape, X, aux, d_carries)
        else:
            dX = _tree_backward(plan, shape, X, ctx.saved_scan, d_carries)
        # token, X, then no gradient for q, k, v, g (ordering only) nor the rest.
        return (torch.zeros((), dtype=torch.float32), dX, *([None] * 8))


def _allgather_backward(
    plan: Plan, shape: S.SummaryShape, X: torch.Tensor, gathered: torch.Tensor, d: torch.Tensor
) -> torch.Tensor:
    """d(carries) -> d(gathered) by the local fold's VJP -> reduce-scatter to owners."""
    with torch.enable_grad():
        G = gathered.detach().requires_grad_(True)
        carries = S.exclusive_prefixes(shape, _global_order(plan, G), [p.m for p in plan.own])
        dG = None
        if carries.requires_grad:
            (dG,) = torch.autograd.grad(carries, (G,), d, allow_unused=True)
    if dG is None:
        dG = torch.zeros_like(gathered)
    P = plan.world_size
    if P == 1:
        return dG[0]
    out = X.new_empty(X.numel())
    _reduce_scatter_single(out, dG.reshape(-1).contiguous(), group=plan.group)
    count("summary_grad", (P - 1) * _nbytes(out))
    return out.view_as(X)


def scan(
    plan: Plan,
    shape: S.SummaryShape,
    method: str,
    X: torch.Tensor,
    pending: Pending,
    deps: tuple[torch.Tensor | None, ...],
) -> torch.Tensor:
    """Finish the exchange started by :func:`start`; return the carries [n, D]."""
    token, carries = _Scan.apply(plan.token, X, *deps, pending, plan, shape, method)
    plan.token = token
    return carries


class _AllReduce(torch.autograd.Function):
    """(token, x) -> (token, sum of x over ranks); backward: the same sum of the grads.

    The global loss is the sum of the ranks' losses, so a replicated output's
    gradient is the sum of every rank's gradient of it.
    """

    @staticmethod
    def forward(ctx, token, x, plan):
        ctx.plan = plan.for_backward()
        out = x.detach().clone()
        if plan.world_size > 1:
            dist.all_reduce(out, group=plan.group)
            count("final", 2 * (plan.world_size - 1) * _nbytes(out) // plan.world_size)
        return token.new_zeros(()), out

    @staticmethod
    def backward(ctx, d_token, d_out):
        plan = ctx.plan
        g = d_out.detach().clone().contiguous()
        if plan.world_size > 1:
            dist.all_reduce(g, group=plan.group)
            count("final_grad", 2 * (plan.world_size - 1) * _nbytes(g) // plan.world_size)
        return torch.zeros((), dtype=torch.float32), g, None


def all_reduce(plan: Plan, x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the group (ordered by the call's token)."""
    token, out = _AllReduce.apply(plan.token, x, plan)
    plan.token = token
    return out


class _Tie(torch.autograd.Function):
    """Returns x unchanged; in backward hands the token a zero gradient, so every
    collective of the call is reached from the call's output on every rank."""

    @staticmethod
    def forward(ctx, x, token):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        return dx, torch.zeros((), dtype=torch.float32)


def tie(x: torch.Tensor, plan: Plan) -> torch.Tensor:
    """``x`` tied to the call's latest token (a no-op when nothing needs gradients)."""
    if not plan.needs_grad:
        return x
    return _Tie.apply(x, plan.token)

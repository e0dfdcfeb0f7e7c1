"""The exchange of segment summaries between ranks, forward and backward.

The methods, one entry each in the table :data:`EXCHANGES` (name -> forward start,
reverse start; an unknown name raises in both directions), compute the same exclusive
scan (the carry into each of this rank's pieces) over the pieces in global order:

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
- the first node of a primitive stage's exchange (:class:`_Begin`) also takes q, k, v,
  g as inputs (with no gradient), so a later call's collectives always run before an
  earlier call's, even on a rank whose shard is empty.

The exchange starts before the expensive local outputs are computed (:func:`begin`),
the all-gather as an asynchronous collective, ring and tree (:mod:`hla_sp.parallel.p2p`)
on a helper thread, and is finished after them (:func:`scan`). The backward mirrors
this: the scan's backward starts the reverse exchange (an asynchronous reduce-scatter,
or ring/tree on a helper thread) and the begin's backward waits for it, so the
backward of the local outputs runs while the summaries' gradients travel. Bytes sent
by this rank are counted per category (:mod:`hla_sp.parallel.comm`).

Under torch.compile none of this traces (helper threads, Python objects in autograd
contexts): the all-gather method becomes a functional all-gather and the same fold
(:func:`traced_scan`), and the token chain a chain of exact zeros that depend on each
all-gather's output (:func:`traced_gather`); autograd derives the reverse.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from hla_sp.parallel import summaries as S
from hla_sp.parallel.comm import (  # noqa: F401  (re-exported: the counters' public home)
    Pending,
    all_gather_single,
    blocked_seconds,
    count,
    gathered,
    on_thread,
    reduce_scatter_single,
    reset_traffic,
    size_bytes,
    traffic,
)
from hla_sp.parallel.p2p import ring_backward, ring_forward, tree_backward, tree_forward
from hla_sp.parallel.plan import METHODS, Chain, Plan


class Scanned(NamedTuple):
    """What a forward exchange gives once waited for (the same for every method)."""

    carries: torch.Tensor  # [n_own, D]: the carry into each of this rank's pieces
    aux: torch.Tensor  # saved for the reverse: allgather, the gathered [P, n, D]; else carries
    saved: object  # anything else the reverse needs (tree: its rounds), or None


# start(plan, shape, X [n, D]) -> Pending of a Scanned
Start = Callable[[Plan, S.SummaryShape, torch.Tensor], Pending]
# reverse(plan, shape, X, aux, saved, d(carries) [n, D]) -> Pending of d(X) [n, D]
Reverse = Callable[
    [Plan, S.SummaryShape, torch.Tensor, torch.Tensor, object, torch.Tensor], Pending
]


class Method(NamedTuple):
    """One exchange method: its forward start and its reverse start."""

    start: Start
    reverse: Reverse


class _Then(Pending):
    """A pending exchange finished by local work after the wait; only the wait counts as
    blocked time (:func:`hla_sp.parallel.comm.blocked_seconds`)."""

    def __init__(self, inner: Pending, then: Callable[[Any], Any]):
        # Not Pending's timed wait around both: the inner wait is timed on its own.
        self._inner, self._then = inner, then

    def wait(self) -> Any:
        return self._then(self._inner.wait())


def _allgather_start(plan: Plan, shape: S.SummaryShape, X: torch.Tensor) -> Pending:
    """One asynchronous all-gather of every rank's summaries; the fold after the wait."""
    P = plan.world_size
    flat = X.reshape(-1).contiguous()
    if P == 1:
        gathered = Pending(lambda: flat.view(1, *X.shape))
    else:
        out = flat.new_empty(P * flat.numel())
        work = all_gather_single(out, flat, group=plan.group, async_op=True)
        count("summary", (P - 1) * size_bytes(flat))

        def wait() -> torch.Tensor:
            work.wait()
            return out.view(P, *X.shape)

        gathered = Pending(wait)

    def fold(G: torch.Tensor) -> Scanned:
        return Scanned(_fold(plan, shape, G), G, None)

    return _Then(gathered, fold)


def _ring_start(plan: Plan, shape: S.SummaryShape, X: torch.Tensor) -> Pending:
    def run() -> Scanned:
        carries = ring_forward(plan, shape, X)
        return Scanned(carries, carries, None)

    return on_thread(run)


def _tree_start(plan: Plan, shape: S.SummaryShape, X: torch.Tensor) -> Pending:
    def run() -> Scanned:
        carries, rounds = tree_forward(plan, shape, X)
        return Scanned(carries, carries, rounds)

    return on_thread(run)


# The reverse starts, of the Reverse signature.
def _allgather_reverse(
    plan: Plan, shape: S.SummaryShape, X: torch.Tensor, gathered: torch.Tensor,
    saved: object, d: torch.Tensor,
) -> Pending:
    """d(carries) -> d(gathered) by the local fold's VJP -> reduce-scatter to owners
    (asynchronous: the begin's backward waits for it)."""
    with torch.enable_grad():
        G = gathered.detach().requires_grad_(True)
        carries = _fold(plan, shape, G)
        dG = None
        if carries.requires_grad:
            (dG,) = torch.autograd.grad(carries, (G,), d, allow_unused=True)
    if dG is None:
        dG = torch.zeros_like(gathered)
    P = plan.world_size
    if P == 1:
        return Pending(lambda: dG[0])
    out = X.new_empty(X.numel())
    work = reduce_scatter_single(out, dG.reshape(-1).contiguous(), group=plan.group,
                                 async_op=True)
    count("summary_grad", (P - 1) * size_bytes(out))

    def wait() -> torch.Tensor:
        work.wait()
        return out.view_as(X)

    return Pending(wait)


def _ring_reverse(plan: Plan, shape: S.SummaryShape, X: torch.Tensor,
                  carries: torch.Tensor, saved: object, d: torch.Tensor) -> Pending:
    return on_thread(lambda: ring_backward(plan, shape, X, carries, d))


def _tree_reverse(plan: Plan, shape: S.SummaryShape, X: torch.Tensor,
                  carries: torch.Tensor, rounds: object, d: torch.Tensor) -> Pending:
    return on_thread(lambda: tree_backward(plan, shape, X, rounds, d))  # type: ignore[arg-type]


# The exchange table, name -> (forward start, reverse start): the only place where a
# method's functions are named. Its names are hla_sp.config's SPMethod (which must stay
# torch-free, so it cannot import this table); the check below ties the two at import.
EXCHANGES: Mapping[str, Method] = MappingProxyType({
    "allgather": Method(_allgather_start, _allgather_reverse),
    "ring": Method(_ring_start, _ring_reverse),
    "tree": Method(_tree_start, _tree_reverse),
})
if tuple(EXCHANGES) != METHODS:
    raise ImportError(
        f"hla_sp.parallel.exchange: the exchange table's methods {tuple(EXCHANGES)} must be "
        f"hla_sp.config.SPMethod's {METHODS}, in order"
    )


def method_of(method: str) -> Method:
    """The table's entry for ``method``; a ValueError names the known methods."""
    try:
        return EXCHANGES[method]
    except (KeyError, TypeError):  # TypeError: an unhashable value
        raise ValueError(
            f"method: expected one of {tuple(EXCHANGES)}, got {method!r}"
        ) from None


def start(method: str, plan: Plan, shape: S.SummaryShape, X: torch.Tensor) -> Pending:
    """Start exchanging this rank's summaries X [n_own, D] (detached); waiting gives a
    :class:`Scanned` (the carries [n_own, D] and what the reverse needs)."""
    return method_of(method).start(plan, shape, X)


def _fold(plan: Plan, shape: S.SummaryShape, G: torch.Tensor) -> torch.Tensor:
    """Every rank's summaries [P, n, D] -> the carry into each of this rank's pieces
    [n, D]: the all-gather method's local fold (the signatures compared on the way)."""
    in_order = torch.stack([G[p.owner, p.slot] for p in plan.pieces])  # global piece order
    return S.exclusive_prefixes(shape, in_order, [p.m for p in plan.own])


def traced_scan(plan: Plan, shape: S.SummaryShape, X: torch.Tensor) -> torch.Tensor:
    """The all-gather method as one differentiable expression, X [n, D] -> carries
    [n, D]: a functional all-gather and the fold, which torch.compile traces. Autograd
    derives the reverse (the fold's vector-Jacobian product, then a reduce-scatter),
    the eager method's reverse."""
    return _fold(plan, shape, traced_gather(plan, X))


def zero_of(*xs: torch.Tensor | None) -> torch.Tensor:
    """A 0-d fp32 zero that depends on ``xs`` in autograd without reading their values
    (a select, not a product: a NaN in them stays out)."""
    dep = sum(x.reshape(-1)[:1].sum().float() for x in xs if x is not None)
    device = next(x.device for x in xs if x is not None)
    return torch.where(torch.zeros((), dtype=torch.bool, device=device), dep, 0.0)


def traced_gather(plan: Plan, x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` [P, *x.shape] by one functional all-gather (torch.compile's
    form), on the call's token chain: its input takes the token and its output gives
    the next. So, as in eager mode, every rank's backward runs every reduce-scatter of
    the call, in the reverse of the forward order, whatever each rank's graph reads."""
    chain = chain_of(plan)
    out = gathered(x + chain.token.to(x.dtype), plan.group, plan.world_size)
    chain.token = zero_of(out)
    return out


class Exchange:
    """One exchange's two halves: the forward exchange in flight (from :func:`begin`
    to :func:`scan`) and then, in backward, the reverse exchange in flight (from the
    scan's backward to the begin's backward)."""

    def __init__(self, pending: Pending):
        self.pending: Pending | None = pending
        self.reverse: Pending | None = None
        # Local backward work to run while the reverse exchange travels: registered by
        # the stage's outputs in their backward, run by the scan's backward.
        self.during_reverse: list[Callable[[], None]] = []


class _Begin(torch.autograd.Function):
    """(token, X, q, k, v, g) -> (token, X): where the exchange starts. Its backward
    waits for the reverse exchange that the scan's backward started, so the backward
    of everything computed between the two (the expensive local outputs) runs while
    the summaries' gradients travel. It also takes q, k, v, g (no gradient), so a
    later call's collectives always run before an earlier call's, even on a rank whose
    shard is empty."""

    @staticmethod
    def forward(ctx, token, X, q, k, v, g, ex):
        ctx.ex = ex
        return token.new_zeros(()), X.detach().clone()

    @staticmethod
    def backward(ctx, d_token, d_X):
        if ctx.ex.reverse is None:  # the scan's backward always runs first (token chain)
            raise RuntimeError("exchange: the reverse exchange was never started")
        dX = ctx.ex.reverse.wait()
        ctx.ex.reverse = None  # not kept alive by the graph
        return torch.zeros((), dtype=torch.float32), dX, *([None] * 5)


class _Scan(torch.autograd.Function):
    """(token, X [n, D]) -> (token, carries [n, D]); collective both ways. Its backward
    starts the reverse exchange and returns at once (see :class:`_Begin`)."""

    @staticmethod
    def forward(ctx, token, X, ex, plan, shape, method):
        ctx.plan, ctx.shape, ctx.method, ctx.ex = plan.for_backward(), shape, method, ex
        carries, aux, ctx.saved_scan = ex.pending.wait()
        ctx.save_for_backward(X, aux)
        ex.pending = None
        return token.new_zeros(()), carries.detach().clone()

    @staticmethod
    def backward(ctx, d_token, d_carries):
        plan, shape = ctx.plan, ctx.shape
        X, aux = ctx.saved_tensors
        if d_carries is None:
            d_carries = torch.zeros(len(plan.own), shape.size, dtype=X.dtype, device=X.device)
        d_carries = d_carries.to(X.dtype)
        ctx.ex.reverse = start_reverse(ctx.method, plan, shape, X, aux, ctx.saved_scan,
                                       d_carries)
        while ctx.ex.during_reverse:
            ctx.ex.during_reverse.pop(0)()
        # The token's gradient is defined, so the begin's backward runs; X's comes there.
        return torch.zeros((), dtype=torch.float32), None, *([None] * 4)


def start_reverse(
    method: str, plan: Plan, shape: S.SummaryShape, X: torch.Tensor, aux: torch.Tensor,
    saved: object, d_carries: torch.Tensor,
) -> Pending:
    """Start the reverse exchange: d(carries) [n, D] -> d(X) [n, D] when waited for.
    ``aux`` and ``saved`` are the forward's :class:`Scanned` fields."""
    return method_of(method).reverse(plan, shape, X, aux, saved, d_carries)


def begin(
    plan: Plan, shape: S.SummaryShape, X: torch.Tensor, deps: tuple[torch.Tensor | None, ...]
) -> tuple[Exchange, torch.Tensor]:
    """Start exchanging this rank's summaries X [n_own, D] (step 2 of the primitive);
    returns the exchange and X as the scan must take it (through the begin node)."""
    ex = Exchange(start(plan.method, plan, shape, X.detach()))
    chain = chain_of(plan)
    chain.token, Xb = _Begin.apply(chain.token, X, *deps, ex)
    return ex, Xb


def scan(plan: Plan, shape: S.SummaryShape, ex: Exchange, X: torch.Tensor) -> torch.Tensor:
    """Finish the exchange started by :func:`begin`; return the carries [n, D]."""
    chain = chain_of(plan)
    chain.token, carries = _Scan.apply(chain.token, X, ex, plan, shape, plan.method)
    return carries


class _AllReduce(torch.autograd.Function):
    """(token, x) -> (token, sum of x over ranks); backward: the same sum of the grads.

    The global loss is the sum of the ranks' losses, so a replicated output's
    gradient is the sum of every rank's gradient of it.
    """

    @staticmethod
    def forward(ctx, token, x, plan):
        ctx.plan = plan.for_backward()
        return token.new_zeros(()), summed(plan, x, "final")

    @staticmethod
    def backward(ctx, d_token, d_out):
        return torch.zeros((), dtype=torch.float32), summed(ctx.plan, d_out, "final_grad"), None


def summed(plan: Plan, x: torch.Tensor, category: str) -> torch.Tensor:
    """A copy of ``x`` summed over the group (one all-reduce, its bytes counted under
    ``category``); no ordering token: for use inside a token-ordered Function."""
    out = x.detach().contiguous().clone()
    if plan.world_size > 1:
        dist.all_reduce(out, group=plan.group)
        count(category, 2 * (plan.world_size - 1) * size_bytes(out) // plan.world_size)
    return out


def all_reduce(plan: Plan, x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the group (ordered by the call's token; under torch.compile a
    functional all-gather and a sum, whose reverse sums the gradients over ranks too)."""
    if torch.compiler.is_compiling():
        return traced_gather(plan, x).sum(0)
    chain = chain_of(plan)
    chain.token, out = _AllReduce.apply(chain.token, x, plan)
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
    """``x`` tied to the call's latest token (a no-op when nothing needs gradients, and
    under torch.compile an exact + 0 that depends on the token)."""
    if not plan.needs_grad:
        return x
    if torch.compiler.is_compiling():
        return x + chain_of(plan).token.to(x.dtype)
    return _Tie.apply(x, chain_of(plan).token)


def chain_of(plan: Plan) -> Chain:
    """The call's ordering chain; a backward-only plan (no chain) runs no new collective."""
    if plan.chain is None:
        raise RuntimeError("exchange: this plan has no ordering chain (a backward-only copy)")
    return plan.chain

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
as an asynchronous collective, ring and tree (:mod:`hla_sp.parallel.p2p`) on a helper
thread. Bytes sent by this rank are counted per category (:mod:`hla_sp.parallel.comm`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hla_sp.parallel import summaries as S
from hla_sp.parallel.comm import (  # noqa: F401  (re-exported: the counters' public home)
    Pending,
    all_gather_single,
    blocked_seconds,
    count,
    on_thread,
    reduce_scatter_single,
    reset_traffic,
    size_bytes,
    traffic,
)
from hla_sp.parallel.p2p import ring_backward, ring_forward, tree_backward, tree_forward
from hla_sp.parallel.plan import Chain, Plan


def start(method: str, plan: Plan, shape: S.SummaryShape, X: torch.Tensor) -> Pending:
    """Start exchanging this rank's summaries X [n_own, D] (detached)."""
    if method == "allgather":
        P = plan.world_size
        flat = X.reshape(-1).contiguous()
        if P == 1:
            return Pending(lambda: flat.view(1, *X.shape))
        out = flat.new_empty(P * flat.numel())
        work = all_gather_single(out, flat, group=plan.group, async_op=True)
        count("summary", (P - 1) * size_bytes(flat))

        def wait() -> torch.Tensor:
            work.wait()
            return out.view(P, *X.shape)

        return Pending(wait)
    if method == "ring":
        return on_thread(lambda: ring_forward(plan, shape, X))
    if method == "tree":
        return on_thread(lambda: tree_forward(plan, shape, X))
    raise ValueError(f"method: expected allgather, ring or tree, got {method!r}")



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
            dX = ring_backward(plan, shape, X, aux, d_carries)
        else:
            dX = tree_backward(plan, shape, X, ctx.saved_scan, d_carries)
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
    reduce_scatter_single(out, dG.reshape(-1).contiguous(), group=plan.group)
    count("summary_grad", (P - 1) * size_bytes(out))
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
    chain = _chain(plan)
    chain.token, carries = _Scan.apply(chain.token, X, *deps, pending, plan, shape, method)
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
            count("final", 2 * (plan.world_size - 1) * size_bytes(out) // plan.world_size)
        return token.new_zeros(()), out

    @staticmethod
    def backward(ctx, d_token, d_out):
        plan = ctx.plan
        g = d_out.detach().clone().contiguous()
        if plan.world_size > 1:
            dist.all_reduce(g, group=plan.group)
            count("final_grad", 2 * (plan.world_size - 1) * size_bytes(g) // plan.world_size)
        return torch.zeros((), dtype=torch.float32), g, None


def all_reduce(plan: Plan, x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the group (ordered by the call's token)."""
    chain = _chain(plan)
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
    """``x`` tied to the call's latest token (a no-op when nothing needs gradients)."""
    if not plan.needs_grad:
        return x
    return _Tie.apply(x, _chain(plan).token)


def _chain(plan: Plan) -> Chain:
    """The call's ordering chain; a backward-only plan (no chain) runs no new collective."""
    if plan.chain is None:
        raise RuntimeError("exchange: this plan has no ordering chain (a backward-only copy)")
    return plan.chain

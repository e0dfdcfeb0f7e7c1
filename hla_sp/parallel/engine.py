"""The sequence-parallel engine, ``SequenceParallel``: how a sequence is sharded over a
group, the ranks' agreement on every call, and the primitive on a shard.

**Agreement.** Every rank of the group must make the same call (shapes, dtype, layout,
method, operator, scale, the log_decay kind and a per-head constant's values, each
named option, an initial state's values, document boundaries, grad mode); otherwise a
collective would hang or compute with one rank's values. Two ways to check it:

- the *full check* (:mod:`hla_sp.parallel.agreement`): one all-gather of a small
  int64 row per rank, read on the host, and a ValueError naming what differs, its
  value on each rank and on which ranks, raised with the same text on every rank;
- the *signature*: the same facts hashed into one 63-bit word (tensor values by an
  on-device digest, the log_decay sign by an on-device bit, so no host read), which
  rides in the first all-gather the math makes anyway: the conv halo of a layer
  (:mod:`hla_sp.nn.conv`) or the summaries' all-gather (``method="allgather"``,
  :mod:`hla_sp.parallel.summaries`). Every rank receives every rank's word and
  compares them on the device before any collective that the call's options decide.

``check`` chooses: ``"always"`` runs the full check on every call (debugging);
``"never"`` runs none; ``"auto"`` (default) runs it on the first call of each
operator kind on this object, and afterwards relies on the signature.

Why the signature, and not "check when my call changed": a decision to check must be
the same on every rank, or the rank that checks waits in a collective the others never
join. If one rank changes an option at step 10, only its local signature changes. With
the signature carried in a collective every rank makes anyway, no rank decides
anything alone: every rank sees the same table of words, so a mismatch fails on every
rank at the same collective. On CPU the device assert raises at once, and every rank
then runs the full check together for the detailed ValueError; on an accelerator it
is a device-side assert ordered on the stream before every later collective (run
with ``check="always"`` for the message). The same holds for a different
``cu_seqlens`` on one rank (its bounds are hashed into the word, through the digest
its plan computed once); a batch plan (:meth:`SequenceParallel.plan_batch`) compares
the ranks' offsets when it is built.

Where no all-gather reaches every rank (ring and tree exchange only point-to-point
messages: a rank's carry holds only the earlier pieces), auto repeats the full check
on a schedule every rank shares, every ``RECHECK_EVERY``-th call of each kind; a
change on one rank in between is not caught (it may block in a collective): use
``check="always"`` there. A contiguous layout without a batch plan
(:meth:`SequenceParallel.plan_batch`) runs the full check on every call: it must
learn the other ranks' local lengths anyway. Also not covered
after a kind's first call under auto: a rank that
changes what sets the first collective's size (B, heads, head dims, dtype,
``normalize``) or calls another operator kind than the others; and a problem of the
rank's own shard (an odd zigzag length, offsets that do not end at T) raises on that
rank alone.

Under torch.compile the full check cannot run (it reads the host): ``check_call``
returns a plan without it (:meth:`SequenceParallel._traced_plan`), and under "auto"
the signature is the check of every call, the first included. "always", ring and
tree, and a contiguous layout without a batch plan are refused there by name.

:meth:`SequenceParallel.check_call` returns the call's plan (a
:class:`~hla_sp.parallel.plan.Plan` with its signature), which the caller hands to
every primitive stage of the call: ``SequenceParallel`` itself is configuration plus
which kinds it has checked. It implements the protocol
:class:`hla_sp.ops.sp_protocol.SequenceParallelism` that the operators call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hla_sp.ops.sharding import BatchPlan
from hla_sp.ops.validate import Inputs

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
from hla_sp.parallel.agreement import disagreements, gather_rows, metadata_row, named_options
from hla_sp.parallel.batch import plan_batch
from hla_sp.parallel.exchange import zero_of
from hla_sp.parallel.groups import member_group, resolve_group
from hla_sp.parallel.layouts import LAYOUTS, call_problems, layout_pieces
from hla_sp.parallel.plan import METHODS, Chain, Plan
from hla_sp.parallel.primitive import sp_primitive
from hla_sp.parallel.signature import SignedPlan, call_signature, decay_ok, recheck_mismatch

__all__ = ["CHECKS", "METHODS", "SequenceParallel"]

CHECKS = ("auto", "always", "never")
# Calls whose first collective is the conv halo's all-gather (every rank sees every
# rank's signature whatever the method).
HALO_OPS = ("short-conv/",)
# Without a signature (ring, tree), auto repeats the full check on this shared schedule.
RECHECK_EVERY = 64


@dataclass
class SequenceParallel:
    """Sequence parallelism over a process group, passed as ``sp=`` to every operator.

    Each rank passes its local shard [B, T_local, H, *]; ``cu_seqlens`` and
    ``initial_state`` are global and the same on every rank, and so must be
    ``output_final_state`` (it decides whether the final states are all-reduced).

    Gradients follow "the global loss is the sum of the ranks' losses": a replicated
    input (``initial_state``, a per-head ``log_decay``) gets on each rank the part of
    its gradient that flows from that rank, and the sum over ranks (what a gradient
    all-reduce computes) is the single-process gradient; a replicated output (the
    final state) passes back the sum of every rank's gradient of it. Under grad mode
    every call builds its backward collectives, so every rank must call backward.
    """

    group: dist.ProcessGroup | DeviceMesh | None = None
    """The process group; None for the default (WORLD) group. A ``DeviceMesh``
    (torchtitan, FSDP2) is taken too: a 1-D mesh (``mesh["cp"]``) as it is, a larger
    one through its dimension ``mesh_dim``; the group is resolved once, here."""
    layout: str = "contiguous"
    """"contiguous": rank r holds the r-th piece (any lengths, may be empty);
    "zigzag": 2P equal chunks, rank r holds chunks r and 2P-1-r."""
    method: str = "allgather"
    """Exchange of summaries: "allgather" (one collective), "ring" (P-1 hops) or
    "tree" (ceil(log2 M) rounds of point-to-point messages, M pieces)."""
    check_timeout_s: float | None = 600.0
    """How long the per-call agreement check waits for every rank to join it before
    raising (a rank that failed its own argument checks never joins); None waits as
    long as the process group's own timeout. 600 s is NCCL's default timeout."""
    overlap: bool = True
    """Compute the local outputs while the summaries are exchanged. False waits for the
    exchange first: benchmarks use it to measure how much of the exchange the overlap
    hides. Results are the same either way."""
    mesh_dim: str | int | None = None
    """With a ``DeviceMesh`` of more than one dimension as ``group``: the name (or
    index) of its context-parallel dimension, e.g. ``"cp"``."""
    check: str = "auto"
    """When the ranks' agreement on a call is checked (module docs): "auto" (the
    first call of each operator kind by the full check, then by the signature that
    rides in the call's first all-gather), "always" (the full check on every call,
    one host read each: for debugging) or "never"."""
    _agreed: set = field(default_factory=set, init=False, repr=False, compare=False)
    _calls: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.group = resolve_group(self.group, self.mesh_dim)
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {self.layout!r}")
        if self.method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {self.method!r}")
        if self.check not in CHECKS:
            raise ValueError(f"check: expected one of {CHECKS}, got {self.check!r}")
        if not isinstance(self.overlap, bool):
            raise TypeError(f"overlap: expected a bool, got {type(self.overlap).__name__}")
        t = self.check_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0):
            raise ValueError(f"check_timeout_s: expected a number > 0 or None, got {t!r}")

    def _group(self) -> dist.ProcessGroup:
        return member_group(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self._group())

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self._group())

    def check_call(
        self,
        inputs: Inputs,
        *,
        op: str,
        options: Mapping[str, object] | Sequence[tuple[str, object]],
    ) -> Plan:
        """Check that every rank agrees on this call (module docs: by the full check or
        the signature, as ``check`` says); raise the same error everywhere.

        ``options`` names every option that must agree: a mapping name -> value, or
        (name, value) pairs. A value is None, a bool, int, float or str (compared
        exactly), or a tensor or tuple of tensors such as an initial state (compared by
        whether one is given and a digest of its values). Scale and log_decay come from
        ``inputs``. Returns the call's :class:`Plan`, which every primitive stage of
        the call takes (``plan=``).
        """
        group = self._group()
        rank, P = dist.get_rank(group), dist.get_world_size(group)
        docs = inputs.plan  # the documents as Python ints (converted once, by their plan)
        bounds = None if docs is None else docs.bounds
        batch = self._batch_plan(docs, group, rank, P)
        named = named_options(options)
        if torch.compiler.is_compiling():
            return self._traced_plan(inputs, op, named, docs, batch, group, P)
        foldable = op.startswith(HALO_OPS) or self.method == "allgather"
        # Every rank's length follows from mine, or the batch plan gathered them.
        known = self.layout == "zigzag" or P == 1 or batch is not None
        calls = self._calls[op] = self._calls.get(op, -1) + 1  # the same count on every rank
        full = (self.check == "always"
                or (self.check == "auto" and (op not in self._agreed or (
                    not foldable and calls % RECHECK_EVERY == 0)))
                or not known)
        if full:
            lengths = self._full_check(inputs, op, named, bounds, group, P)
            if self.check == "auto":
                self._agreed.add(op)
        else:
            lengths = (inputs.T,) * P if batch is None else batch.lengths
            problems = call_problems(self.layout, lengths, bounds)
            if problems:  # this rank's own shard: every rank with the same shard raises
                raise ValueError("SequenceParallel: " + "; ".join(problems))
        signature = None  # a fully checked call needs none (every rank checked it)
        if self.check == "auto" and foldable and P > 1 and not full:
            signature = call_signature(inputs, op, named, 0 if docs is None else docs.digest,
                                       lengths, self.layout, self.method)
        needs_grad = torch.is_grad_enabled()
        token = torch.zeros((), dtype=torch.float32, requires_grad=needs_grad)

        def recheck() -> None:
            self._full_check(inputs, op, named, bounds, group, P)

        return SignedPlan(
            rank=rank, world_size=P, group=group, method=self.method, overlap=self.overlap,
            lengths=lengths, pieces=batch.pieces if batch is not None and lengths == batch.lengths
            else tuple(layout_pieces(self.layout, list(lengths))),
            T=sum(lengths), bounds=bounds, needs_grad=needs_grad, chain=Chain(token),
            signature=signature, recheck=recheck,
        )

    def _traced_plan(
        self, inputs: Inputs, op: str, named: list[tuple[str, object]],
        docs: BatchPlan | None, batch: BatchPlan | None, group: dist.ProcessGroup, P: int,
    ) -> Plan:
        """:meth:`check_call` under torch.compile: no host read and no collective of its
        own. Every rank's length must be known without asking (a batch plan, or the
        zigzag layout), the exchange must be the all-gather (ring and tree run on helper
        threads), and under ``check="auto"`` the signature is the whole check, on every
        call (module docs)."""
        if self.method != "allgather" and P > 1:
            raise ValueError(
                f"method: torch.compile traces method='allgather' only (ring and tree "
                f"exchange on helper threads), got {self.method!r}")
        if self.check == "always":
            raise ValueError(
                "check: 'always' reads every rank's call on the host, which a compiled "
                "function cannot do; got 'always' under torch.compile: use 'auto' or "
                "'never' there, and 'always' in eager mode to debug")
        if batch is None and self.layout == "contiguous" and P > 1:
            raise ValueError(
                "plan: under torch.compile a contiguous layout needs the batch's plan "
                "(sp.plan_batch(T_local, cu_seqlens), built outside the compiled "
                "function: it learns every rank's length); got "
                + ("offsets only" if docs is not None else "no plan"))
        bounds = None if docs is None else docs.bounds
        lengths = (inputs.T,) * P if batch is None else batch.lengths
        problems = call_problems(self.layout, lengths, bounds)
        if problems:
            raise ValueError("SequenceParallel: " + "; ".join(problems))
        signature = None
        if self.check == "auto" and P > 1:
            signature = call_signature(inputs, op, named, 0 if docs is None else docs.digest,
                                       lengths, self.layout, self.method)
        return SignedPlan(
            rank=dist.get_rank(group), world_size=P, group=group, method=self.method,
            overlap=self.overlap, lengths=lengths,
            pieces=batch.pieces if batch is not None
            else tuple(layout_pieces(self.layout, list(lengths))),
            T=sum(lengths), bounds=bounds, needs_grad=torch.is_grad_enabled(),
            chain=Chain(zero_of(inputs.q, inputs.k, inputs.v, inputs.g)), signature=signature,
        )

    def plan_batch(self, T_local: int, cu_seqlens: torch.Tensor | None = None) -> BatchPlan:
        """The plan of one batch, for every layer and stage of it (``plan=``).

        Args:
            T_local: this rank's tokens (its shard's length).
            cu_seqlens: the batch's GLOBAL document offsets [N + 1] (B == 1), the same
                on every rank, or None.

        Returns a :class:`~hla_sp.ops.sharding.BatchPlan` with the offsets, every rank's
        length and the layout's pieces as Python ints; it costs at most one all-gather
        and one host read (:mod:`hla_sp.parallel.batch`), and every rank must build it.
        """
        return plan_batch(self._group(), self.layout, T_local, cu_seqlens,
                          gather=not (self.check == "never" and self.layout == "zigzag"),
                          timeout_s=self.check_timeout_s)

    def _batch_plan(self, docs: BatchPlan | None, group: dist.ProcessGroup, rank: int,
                    P: int) -> BatchPlan | None:
        """The call's plan if :meth:`plan_batch` built it (every rank's length known),
        after checking that it was built for this group and layout."""
        if docs is None or docs.group is None:  # offsets only (planned by the call)
            return None
        if (docs.group is not group or docs.layout != self.layout or docs.rank != rank
                or len(docs.lengths) != P):
            raise ValueError(
                f"plan: expected a plan of this SequenceParallel (layout {self.layout!r}, "
                f"rank {rank} of {P}), got one built for layout {docs.layout!r}, rank "
                f"{docs.rank} of {len(docs.lengths)} (another group or SequenceParallel?)")
        return docs

    def _full_check(
        self, inputs: Inputs, op: str, named: list[tuple[str, object]],
        bounds: tuple[int, ...] | None, group: dist.ProcessGroup, P: int,
    ) -> tuple[int, ...]:
        """The full check (one all-gather, one host read); returns every rank's local T.
        The log_decay sign travels in the row too (one column before local T), so a
        rank's bad decay raises on every rank."""
        row = metadata_row(inputs, op, named, bounds, layout=self.layout, method=self.method)
        row = torch.cat([row[:-1], decay_ok(inputs.g).to(row.device)[None], row[-1:]])
        table = gather_rows(row, group, P, op, self.check_timeout_s)
        lengths = tuple(r[-1] for r in table)
        names = [n for n, _ in named]
        problems = disagreements(table, names) or call_problems(self.layout, lengths, bounds)
        bad = [r for r, row in enumerate(table) if row[-2] == 0]
        if not problems and bad:
            problems = [f"log_decay: expected values <= 0 (gamma = exp(log_decay) <= 1), "
                        f"got a value > 0 or NaN on ranks {bad}"]
        if problems:
            # The same text on every rank: it is built from the gathered table only.
            raise ValueError(
                "SequenceParallel: the ranks of the group disagree on this call: "
                + "; ".join(problems)
            )
        return lengths

    def primitive(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor | None,
        *,
        docs: BatchPlan | None,
        h0: torch.Tensor | None,
        want_final: bool,
        chunk_size: int,
        call: Plan | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The primitive over this rank's shard under ``call``, the :class:`Plan` that
        :meth:`check_call` returned for the operator call (see
        :func:`hla_sp.parallel.primitive.sp_primitive`)."""
        plan = call
        if plan is None:
            raise RuntimeError(
                "SequenceParallel: no checked call matches this shard (local T = "
                f"{q.shape[1]}): the primitive's stages take the plan that "
                "sp.check_call(...) returned for their call (call=...)"
            )
        # A cheap guard (the offsets were converted once, by check_call): a plan of
        # another call would fold the wrong pieces.
        given = None if docs is None else docs.bounds
        if plan.lengths[plan.rank] != q.shape[1] or (plan.bounds is None) != (given is None):
            raise RuntimeError(
                f"SequenceParallel: no checked call matches this shard (local T = "
                f"{q.shape[1]}): the plan was made for local T = {plan.lengths[plan.rank]}"
                f" and {'no' if plan.bounds is None else ''} cu_seqlens"
            )
        try:
            return sp_primitive(
                q, k, v, g, h0=h0, want_final=want_final, chunk_size=chunk_size, plan=plan
            )
        except RuntimeError as e:
            recheck_mismatch(plan, e)
            raise

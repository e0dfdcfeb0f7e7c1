"""The protocol that sequence parallelism implements for the operators.

The operators live below :mod:`hla_sp.parallel` and never import it: they call the
``sp=`` object they are given through this protocol, which
:class:`hla_sp.parallel.SequenceParallel` implements. A public operator checks its
call once (:meth:`SequenceParallelism.check_call`, which returns an immutable plan)
and hands that plan to every primitive stage of the call
(:meth:`SequenceParallelism.primitive`), so the stages share one ordering of their
collectives and nothing of the call is stored on the ``sp`` object.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from hla_sp.ops.sharding import BatchPlan
from hla_sp.ops.validate import Inputs


class SequenceParallelism(Protocol):
    """How a sequence is sharded over ranks; passed as ``sp=`` to every operator."""

    def check_call(
        self,
        inputs: Inputs,
        *,
        op: str,
        options: Mapping[str, object] | Sequence[tuple[str, object]],
    ) -> Any:
        """Check that every rank agrees on this call (the same error on every rank
        otherwise, naming what differs: ``options`` maps each option's name to its
        value; a tensor or tuple of tensors, such as an initial state, is compared by
        a digest of its values); return the call's plan, an immutable object the
        stages pass back."""
        ...

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
        call: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The primitive on this rank's shard [B, T_local, H, *] under ``call``, the
        call's plan that :meth:`check_call` returned.

        ``docs`` (the batch's plan: global offsets [N + 1]) and ``h0`` [N, H, K, V] are
        global; returns this rank's
        outputs [B, T_local, H, V] and the global final states (or None).
        """
        ...

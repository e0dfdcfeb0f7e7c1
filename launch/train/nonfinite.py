"""Non-finite training: the check of each step, the stop's one line, and whether a
checkpoint is finite (what ``--keep-last`` never deletes).

With ``--check-for-nan-in-loss-and-grad`` (Megatron's flag, on by default) the trainer
checks the step's global loss and gradient norm, both read in the step's one host read,
before the optimizer steps; a NaN or infinity raises :class:`NonFiniteError` on every
rank alike (the values are global), so nothing is stepped, saved or pruned, and
:func:`hla_sp.launch.train.main.run` reports its message in one line and exits non-zero.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from hla_sp.launch import checkpoint
from hla_sp.launch.distributed.dist_optimizer import local


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm was NaN or infinite; the message is the run's one
    line: the iteration, the value, and the checkpoint to resume from."""


def non_finite(loss: float, grad_norm: float, skipped: bool) -> str:
    """What was not finite in a step ("loss (nan)", "grad-norm (inf)", both), or "". The
    gradients of an fp16 step the loss scaler skipped are its to handle (an overflow is
    a skip, not a stop); its loss is checked as any other, as Megatron does."""
    bad = [f"loss ({loss})"] if not math.isfinite(loss) else []
    if not skipped and not math.isfinite(grad_norm):
        bad.append(f"grad-norm ({grad_norm})")
    return " and ".join(bad)


def stop_line(cfg: Any, iteration: int, resumed_from: int | None, what: str) -> str:
    """The stop's one line: ``what`` went non-finite in iteration ``iteration`` + 1, and
    the newest finite checkpoint at or before ``iteration`` to go back to (in --save, or
    the one --load resumed)."""
    head = (f"non-finite {what} at iteration {iteration + 1}: stopped before the optimizer "
            f"step, nothing saved")
    hint = "(lower --lr, or --no-check-for-nan-in-loss-and-grad to train on regardless)"
    # not one past this iteration (left by a run this one resumed before)
    good = checkpoint.newest_finite(cfg.checkpoint.save, iteration) if cfg.checkpoint.save else None
    ck = cfg.checkpoint
    where = ((ck.save, good) if good is not None
             else (ck.load, resumed_from) if resumed_from is not None and ck.load
             else None)  # fmt: skip
    if where is None:
        return f"{head}; no finite checkpoint to resume from {hint}"
    return (f"{head}; the last finite checkpoint is iteration {where[1]} in {where[0]}: "
            f"resume with --load {where[0]} --ckpt-step {where[1]} {hint}")


def checkpoint_finite(weights: list[torch.Tensor], last: dict[str, Any] | None) -> bool:
    """Whether a checkpoint counts as finite: every rank's ``weights`` (the fp32
    masters; one reduction, read once, collective) and the loss of its iteration's
    record ``last``, and its gradient norm unless the step was an fp16 skip."""
    # sharded masters (--use-distributed-optimizer): this rank's rows, and the MIN below
    ok = torch.stack([torch.isfinite(local(w)).all() for w in weights]).all()
    flag = ok.to(torch.int32).reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    finite = bool(flag.item())
    if last is not None:
        finite = finite and math.isfinite(last["loss"]) and (
            last.get("skipped", False) or math.isfinite(last["grad_norm"]))
    return finite

"""Non-finite training: the check of each step, the stop's one line, and whether a
checkpoint is finite (what ``--keep-last`` never deletes).

With ``--check-for-nan-in-loss-and-grad`` (Megatron's flag, on by default) the trainer
checks the step's global loss and gradient norm, both read in the step's one host read,
before the optimizer steps; a NaN or infinity raises :class:`NonFiniteError` on every
rank alike (the values are global), so nothing is stepped, saved or pruned, and
:func:`hla_sp.launch.train.main.run` reports its message in one line and exits non-zero.
Without the check (``--no-check-for-nan-in-loss-and-grad``) the run does not stop: a
non-finite step is skipped (no optimizer step, its record says ``skipped``), so the
weights stay finite and the run trains on; a checkpoint whose iteration's loss was
non-finite is still recorded non-finite (its weights gave that loss).

A checkpoint is finite when every tensor it holds is (the model's weights at their
stored dtype, the fp32 masters, the optimizer's state) and so were its iteration's
loss and gradient norm; the manifest records it, and every reader refuses a checkpoint
recorded non-finite.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from hla_sp.launch import checkpoint
from hla_sp.launch.checkpoint import manifest
from hla_sp.launch.distributed.dist_optimizer import half_dtype, local


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


HINT = ("(resume with a lower --lr and --override-opt_param-scheduler, which a changed "
        "schedule needs; or --no-check-for-nan-in-loss-and-grad to train on, non-finite steps "
        "skipped)")


def stop_line(cfg: Any, iteration: int, resumed_from: int | None, what: str) -> str:
    """The stop's one line: ``what`` went non-finite in iteration ``iteration`` + 1, and
    a checkpoint whose forward is finite to go back to (in --save, or the one --load
    resumed), or that none is and what to change.

    A non-finite *loss* comes from the forward of iteration ``iteration``'s weights, so
    the checkpoint of ``iteration`` itself would go non-finite again at any learning
    rate: it is passed over (and marked non-finite, :func:`mark_diverged`), and the
    newest one before it is named, with the lowest-loss one when that is another."""
    head = (f"non-finite {what} at iteration {iteration + 1}: stopped before the optimizer "
            f"step, nothing saved")
    forward = what.startswith("loss")  # the weights of `iteration` give a non-finite loss
    at_most = iteration - 1 if forward else iteration
    ck = cfg.checkpoint
    if forward:
        mark_diverged(ck.save, iteration)
        if ck.load and ck.load != ck.save:
            mark_diverged(ck.load, iteration)
    # not one past this iteration (left by a run this one resumed before)
    where = None
    for root in dict.fromkeys(r for r in (ck.save, ck.load) if r):
        good = checkpoint.newest_finite(root, at_most)
        if good is not None:
            where = (root, good)
            break
    if where is None and resumed_from is not None and ck.load and resumed_from <= at_most:
        where = (ck.load, resumed_from)
    if where is None:
        return (f"{head}; no checkpoint whose forward is finite to resume from: start again "
                f"with a lower --lr (or a longer --lr-warmup-iters, or a smaller --clip-grad)")
    best = manifest.lowest_loss(where[0], at_most)
    also = (f"; the lowest-loss one is iteration {best[0]} (loss {best[1]:.4g})"
            if best is not None and best[0] != where[1] else "")
    return (f"{head}; the last checkpoint whose forward is finite is iteration {where[1]} in "
            f"{where[0]}: resume with --load {where[0]} --ckpt-step {where[1]}{also} {HINT}")


def mark_diverged(root: str | None, iteration: int) -> None:
    """Global rank 0: record checkpoint ``iteration`` under ``root`` (when there) as
    non-finite: its forward gave a non-finite loss, so no reader loads it as finite."""
    if root is None or (dist.is_initialized() and dist.get_rank() != 0):
        return
    d = checkpoint.iter_dir(root, iteration)
    if os.path.isdir(d):
        manifest.mark_non_finite(d, f"the forward of its weights gave a non-finite loss at "
                                    f"iteration {iteration + 1}")


def saved_tensors(model: torch.nn.Module, main: list[torch.Tensor],
                  optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every floating tensor a checkpoint holds, as it is stored, one at a time (a
    rounded copy lives only while it is checked): the model's weights at their stored
    dtype (a sharded half run's fp32 parameters are stored rounded to half, where an
    fp32 value past 65504 becomes inf), the fp32 masters ``main`` and the optimizer's
    state (this rank's shards under --use-distributed-optimizer)."""
    half = half_dtype(model)
    for p in model.parameters():
        if p.is_floating_point():
            yield local(p.detach()).to(half) if half is not None else local(p.detach())
    for m in main:
        yield local(m.detach())
    for state in optimizer.state.values():
        yield from (local(v) for v in state.values()
                    if torch.is_tensor(v) and v.is_floating_point())


def checkpoint_finite(tensors: Iterable[torch.Tensor], last: dict[str, Any] | None) -> bool:
    """Whether a checkpoint counts as finite: every rank's ``tensors`` (all it saves,
    :func:`saved_tensors`; one reduction, read once, collective), the loss of its
    iteration's record ``last`` (a skipped step's too: its weights gave that loss), and
    its gradient norm unless the step was skipped (an fp16 overflow, or a non-finite
    step under --no-check-for-nan-in-loss-and-grad)."""
    flags = [torch.isfinite(t).all() for t in tensors]
    ok = torch.stack(flags).all() if flags else torch.tensor(True)
    flag = ok.to(torch.int32).reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    finite = bool(flag.item())
    if last is not None:
        finite = finite and math.isfinite(last["loss"]) and (
            last.get("skipped", False) or math.isfinite(last["grad_norm"]))
    return finite

"""The hint to train further that ``nothing to do`` and ``done`` give
(:mod:`hla_sp.launch.train.after_training` holds the rest of what ``done`` names).

Training further changes few flags, so the hint names only those. It chooses a fresh
decay over the new iterations, the schedule a user who asks for more iterations most
likely wants: ``--lr-warmup-iters RESUME`` ends the (overridden) schedule's warmup at
the checkpoint's iteration, so the new iterations start again at ``--lr`` and decay
to ``--min-lr`` over themselves (Megatron's scheduler counts steps from 0, and its
warmup from 0 to ``--lr`` lies wholly behind the checkpoint). The alternative,
``--use-checkpoint-opt_param-scheduler``, keeps the checkpoint's schedule, whose decay
is over: the new iterations run at ``--min-lr``.
"""

from __future__ import annotations

import shlex
from typing import Any


def further_flags(cfg: Any, resume: int) -> dict[str, list[str]]:
    """The flags (with their values) that train ``cfg``'s run from iteration ``resume``
    for as many iterations again, on a fresh decay over the new ones."""
    opt = cfg.optimizer
    more = resume + opt.train_iters
    flags = {"--train-iters": [str(more)]}
    if opt.lr_decay_iters is not None:  # the decay ends with the new iterations too
        flags["--lr-decay-iters"] = [str(more)]
    if opt.lr_decay_style != "constant":
        flags["--lr-warmup-iters"] = [str(resume)]
    if not cfg.checkpoint.override_opt_param_scheduler:
        flags["--override-opt_param-scheduler"] = []
    return flags


def train_further(cfg: Any, resume: int) -> str:
    """``to train further, rerun with: FLAGS (why; the alternative)`` for a run at
    ``resume``: the flags to set (or replace) in the run's own command."""
    opt = cfg.optimizer
    more = resume + opt.train_iters
    flags = further_flags(cfg, resume)
    said = " ".join(shlex.join([k, *v]) for k, v in flags.items())
    keep = (f"--train-iters {more} --use-checkpoint-opt_param-scheduler instead keeps the "
            f"checkpoint's schedule, at --min-lr {opt.min_lr:g}")
    if opt.lr_decay_style == "constant":
        return f"to train further, rerun with: {said} (the learning rate stays --lr {opt.lr:g})"
    return (f"to train further, rerun with: {said} (a fresh {opt.lr_decay_style} decay from --lr "
            f"{opt.lr:g} to --min-lr {opt.min_lr:g} over iterations {resume + 1}-{more}; "
            f"{keep})")

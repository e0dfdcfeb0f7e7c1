"""What to run after a training run: the lines ``done`` ends with, and the hint to train
further that ``nothing to do`` gives.

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


def next_commands(cfg: Any, iteration: int) -> list[str]:
    """The lines after ``done``: sample, export, evaluate the checkpoint in --save, and
    train further; one line saying why when nothing was saved."""
    save = cfg.checkpoint.save
    if not save:
        return ["next: nothing was saved (no --save), so there is no checkpoint to sample, "
                "export or evaluate"]
    from hla_sp.launch.generate import GenerateError, check_decodable

    q = shlex.quote(save)
    out = ["next:"]
    try:
        check_decodable(cfg)
        out.append(f"  hla-sp generate --load {q} --prompt 'def ' --max-new-tokens 200")
    except GenerateError:
        pass  # softmax layers or rope: generate refuses them; the export decodes
    out.append(f"  hla-sp export --load {q} --output {shlex.quote(_beside(save, 'hf'))}")
    m = cfg.model
    # learned positions reach no further than their table; the others run at any length
    length = (m.max_position_embeddings or m.seq_length
              if m.position_embedding_type == "learned_absolute" else 4 * m.seq_length)
    out.append(f"  hla-sp eval --load {q} --task ppl-by-position --lengths {length} "
               f"--output {shlex.quote(_beside(save, 'eval'))}")
    out.append(f"  {train_further(cfg, iteration)}")
    return out


def _beside(save: str, name: str) -> str:
    """``runs/demo/ckpt`` -> ``runs/demo/NAME``: an output next to the checkpoint."""
    import os

    parent = os.path.dirname(os.path.normpath(save))
    return os.path.join(parent, name) if parent else name

"""Many seeds of one recall run trained together, in one process, under ``torch.vmap``.

A model of width 128 leaves a GPU idle: its kernels are tiny and each step is a few
hundred launches, so one process per seed is bound by launches and by the processes
taking turns on the GPU, not by FLOPs (docs/quality.md: 32 runs at once on one H200
reached about 3 TFLOP/s in total). Here the seeds' weights are stacked
(``torch.func.stack_module_state``) and one forward runs them all: every kernel works
on N seeds' batches, and the HLA operator is one call on N B sequences (its vmap
rule, :mod:`hla_sp.ops.primitive`).

Each seed is the run :func:`bench_recall.train` makes, up to rounding:

- its weights are drawn from ``torch.manual_seed(seed)``, its batches from its own
  generator;
- its loss is its own batch's mean; the summed loss gives each seed's weights its own
  gradient;
- its gradient is clipped by its own norm; AdamW and the schedule act on each element
  alone, so stacking changes nothing but the kernels' order of summation;
- it is checked, stops early and is cut by the deadline as a run alone would be; a seed
  that stopped keeps training with the others (stacked weights cannot leave the
  stack), but its record is taken at its stop and nothing after counts.

``tests/unit/benchmarks/test_recall_seeds.py`` checks the equality in fp64 against separate runs.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.nn.functional as F
from bench_recall import (
    D_MODEL,
    SOLVED,
    Progress,
    RecallLM,
    held_out,
    lr_schedule,
    make_optimizer,
    mqar_batch,
    run_result,
)
from torch.func import functional_call, stack_module_state


def clip_per_seed(grads: list[torch.Tensor], max_norm: float = 1.0) -> torch.Tensor:
    """In place, ``torch.nn.utils.clip_grad_norm_`` of each seed's gradients alone
    (grads: stacked [N, ...]); returns the N norms before clipping (on the device: no
    host read)."""
    norms = torch.stack([g.flatten(1).double().square().sum(1) for g in grads]).sum(0).sqrt()
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype).view(-1, *([1] * (g.dim() - 1))))
    return norms


def train_seeds(mixer: str, T: int, pairs: int, steps: int, batch: int, seeds: list[int],
                lr: float = 3e-3, d: int = D_MODEL, eval_every: int = 100,
                early_stop: float | None = SOLVED, threads: int = 1, device: str = "cpu",
                deadline: float | None = None) -> list[dict[str, Any]]:
    """Train ``mixer`` at one size for every seed in ``seeds`` at once; one record per
    seed, as :func:`bench_recall.train` returns it, with ``"seeds_together"``: N.

    ``seconds`` of a seed is the group's wall time up to the seed's end."""
    if not seeds:
        raise ValueError("seeds: expected at least one seed, got []")
    torch.set_num_threads(threads)
    dev = torch.device(device)
    models, gens = [], []
    for seed in seeds:
        torch.manual_seed(seed)
        gens.append(torch.Generator().manual_seed(seed + 1))
        models.append(RecallLM(mixer, T, d=d).to(dev))
    data = held_out(T, pairs, dev)
    params, buffers = stack_module_state(models)
    # The stateless copy the stacked weights run through (no storage of its own).
    shell = copy.deepcopy(models[0]).to("meta")

    def one(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], x: torch.Tensor):
        return functional_call(shell, (p, b), (x,))

    forward = torch.vmap(one)
    trained = [p for p in params.values() if p.requires_grad]
    opt = make_optimizer(list(params.items()), mixer, lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(steps))
    progress = [Progress() for _ in seeds]
    done: dict[int, dict[str, Any]] = {}
    gsum = gmax = None
    t0, s, cut = time.perf_counter(), 0, None
    setting = dict(mixer=mixer, T=T, pairs=pairs, d_model=d, steps=steps, batch=batch, lr=lr)

    def finish(i: int, cut_at: int | None) -> None:
        """Seed i's record, from its weights as they are now."""
        unstack(i)
        n = s if cut_at is None else cut_at
        gm = None if gsum is None else (float(gsum[i]) / n, float(gmax[i]))
        done[i] = run_result(models[i], data, progress[i], gm or (None, None),
                             time.perf_counter() - t0, cut_at, **setting, seed=seeds[i],
                             seeds_together=len(seeds))

    @torch.no_grad()
    def unstack(i: int) -> None:
        for name, p in models[i].named_parameters():
            p.copy_(params[name][i])
        for name, b in models[i].named_buffers():
            b.copy_(buffers[name][i])

    for s in range(1, steps + 1):
        if deadline is not None and time.time() >= deadline:
            cut = s - 1
            break
        xs, ys = zip(*(mqar_batch(batch, T, pairs, g) for g in gens), strict=True)
        x, y = torch.stack(xs).to(dev), torch.stack(ys).to(dev)
        logits = forward(params, buffers, x)  # [N, B, T, vocab]
        per_token = F.cross_entropy(logits.flatten(0, 2), y.flatten(), ignore_index=-100,
                                    reduction="none").view(len(seeds), -1)
        losses = per_token.sum(1) / (y != -100).flatten(1).sum(1)  # each seed's mean
        opt.zero_grad(set_to_none=True)
        losses.sum().backward()
        norms = clip_per_seed([p.grad for p in trained])
        gsum = norms if gsum is None else gsum + norms
        gmax = norms if gmax is None else torch.maximum(gmax, norms)
        opt.step()
        sched.step()
        if s % eval_every == 0 or s == steps:
            train_losses = losses.tolist()
            for i in range(len(seeds)):
                if i in done:
                    continue
                unstack(i)
                if progress[i].check(models[i], s, train_losses[i], data, early_stop):
                    finish(i, None)
            if len(done) == len(seeds):
                break
    for i in range(len(seeds)):
        if i not in done:
            finish(i, cut)
    return [done[i] for i in range(len(seeds))]

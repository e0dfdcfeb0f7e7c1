"""Save and load one checkpoint: who writes which file, in which order.

A save is collective. Rank 0 writes ``common.pt`` (iteration, data position, scheduler,
the optimizer's hyperparameters and step, the loss scaler, the parallel layout) and
``config.json``; every rank hands its main-replica pieces of the model, the optimizer
moments and the fp32 master weights to DCP (:mod:`.sharded`) and writes its own RNG
file. A load reads the pieces this run's layout holds, whatever layout wrote them.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
from hla_sp.launch.checkpoint import legacy, lock_held, manifest, sharded
from hla_sp.launch.checkpoint.layout import (
    COMMON,
    CONFIG,
    LATEST,
    LEGACY_MODEL,
    OLD,
    SHARDED,
    CheckpointError,
    atomic_torch_save,
    atomic_write_bytes,
    checkpoint_dir,
    fsync_dir,
    iter_dir,
    latest_iteration,
    prune,
    read_torch_file,
    remove_leftovers,
)
from hla_sp.launch.checkpoint.rng import restore_rng, rng_state
from hla_sp.launch.distributed import drills, faults
from hla_sp.launch.distributed.dist_optimizer import half_dtype

# 1: one torch.save file per TP rank (read by .legacy); 2: DCP; 3: DCP, and a manifest
# is always written (a format-3 checkpoint without one lost it: refused, see .manifest)
FORMAT = manifest.FIRST_FORMAT_WITH_MANIFEST
_COMMON_KEYS = ("format", "iteration", "consumed_samples", "scheduler", "optimizer",
                "masters", "layout", "extra")  # fmt: skip


def layout(world_size: int) -> dict[str, int]:
    """This run's parallel sizes, as ``common.pt`` records them."""
    tp, cp = sharded.parallel_sizes()
    return {"world_size": world_size, "tp": tp, "cp": cp, "dp": world_size // (tp * cp)}


def save(
    root: str,
    iteration: int,
    *,
    rank: int,
    world_size: int,
    tp_rank: int,
    writes_model: bool,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    consumed_samples: int,
    config: dict[str, Any],
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
    finite: bool = True,
    loaded: int | None = None,
    loss: float | None = None,
) -> str:
    """Write a checkpoint collectively (every rank calls it); return its directory.

    ``extra`` holds the fp32 master weights (``main_params``, in the order of the
    model's trainable parameters: written like the model, resharded on load) and small
    values such as the loss scaler (into ``common.pt``). ``writes_model`` names the
    ranks that write a plain module's tensors (one without megatron's
    ``sharded_state_dict``, which says itself who writes what); ``tp_rank`` is kept for
    the callers. The config is also written as ``config.json``, which ``--load``
    compares with the new run's flags before any process group exists. With
    ``keep_last`` N, older checkpoints beyond the newest N are deleted once this one
    is the latest, except the newest one recorded as ``finite`` (the run's loss,
    gradient norm and weights were finite when it was saved) and ``loaded`` (the
    iteration this run resumed from, when it resumed from ``root``) and the finite one
    of the lowest recorded ``loss`` (the iteration's): a run that went non-finite, or
    diverged for a while before, must leave a checkpoint to go back to. Every file's
    size and SHA-256 go into ``manifest.json`` (:mod:`.manifest`), which a load
    verifies.
    """
    del tp_rank  # the pieces carry their place: no per-TP-rank file any more
    with faults.saving(iteration):
        return _save(root, iteration, rank, world_size, writes_model, model, optimizer,
                     scheduler, consumed_samples, config, dict(extra or {}), keep_last,
                     finite, loaded, loss)


def _save(
    root: str, iteration: int, rank: int, world_size: int, writes_model: bool,
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
    consumed_samples: int, config: dict[str, Any], extra: dict[str, Any],
    keep_last: int | None, finite: bool, loaded: int | None, loss: float | None,
) -> str:
    final = iter_dir(root, iteration)
    tmp = final + ".tmp"
    lock_held.check_held(root, iteration, rank)  # never write into a --save another run took
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        remove_leftovers(root)  # of crashed saves, at any iteration (this one included)
        os.makedirs(tmp)
    dist.barrier()
    drills.maybe_inject(rank, iteration, phase="save")
    masters = extra.pop("main_params", None)
    described = sharded.describe_model(model, writes_model)
    half = half_dtype(model)
    if half is not None:  # sharded fp32 masters: written as the masters, and rounded
        masters = list(described.params)  # as the model's weights, the format of a
        for pc in described.of_param:  # half run without the flag
            pc.tensor = pc.tensor.to(half)
    pieces, optim = sharded.optimizer_state(optimizer, described)
    pieces = described.pieces + pieces
    if masters is not None:
        pieces += [pc.like(sharded.MASTER, m) for pc, m in zip(described.of_param, masters)]
    if rank == 0:
        atomic_torch_save(
            {"format": FORMAT, "iteration": iteration, "consumed_samples": consumed_samples,
             "scheduler": scheduler.state_dict(), "optimizer": optim,
             "masters": masters is not None, "layout": layout(world_size), "extra": extra},
            os.path.join(tmp, COMMON))  # fmt: skip
        atomic_write_bytes(
            os.path.join(tmp, CONFIG), json.dumps(config, indent=1, sort_keys=True).encode()
        )
    sharded.write(os.path.join(tmp, SHARDED), pieces)
    atomic_torch_save(
        {"rng": rng_state(), "world_size": world_size, "layout": layout(world_size)},
        os.path.join(tmp, f"rng_rank{rank:05d}.pt"),
    )
    # each rank digests the files it wrote (see .manifest for why not rank 0 alone); the
    # gather returns only once every rank has written and digested everything, so the
    # manifest is complete before the directory becomes visible
    mine = manifest.digest_files(tmp, manifest.rank_files(tmp, rank))
    gathered: list[dict[str, Any] | None] = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if rank == 0:
        manifest.write(tmp, iteration, {k: v for g in gathered for k, v in (g or {}).items()},
                       finite, loss)
        old = final + OLD
        if os.path.isdir(final):
            # re-saving an iteration: move the old copy aside, never delete it first, so
            # that a crash between the two renames still leaves a complete copy
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(root)
        atomic_write_bytes(os.path.join(root, LATEST), f"{iteration}\n".encode())
        fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
        if keep_last is not None:
            best = manifest.lowest_loss(root)
            keep = {manifest.newest_finite(root), loaded, best and best[0]} - {None}
            prune(root, iteration, keep_last, keep=keep)  # type: ignore[arg-type]
    dist.barrier()
    return final


def load(
    root: str,
    *,
    rank: int,
    world_size: int,
    tp_rank: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    step: int | None = None,
) -> dict[str, Any]:
    """Restore the latest (or ``step``'s) checkpoint, at this run's TP, CP and DP sizes
    whatever sizes wrote it (collective); return iteration, data position and ``extra``
    (the fp32 masters as ``main_params`` when saved and this run is half precision)."""
    it = latest_iteration(root) if step is None else step
    if it is None:
        raise FileNotFoundError(
            f"--load {root}: no {LATEST}; it holds no complete checkpoint (was --save used?)"
        )
    d = checkpoint_dir(root, it)
    if not os.path.isdir(d):
        raise FileNotFoundError(f"--load {root}: no complete checkpoint {d}")
    manifest.verify(d, it)  # every file, before any is read (collective)
    manifest.refuse_non_finite(root, d, it)
    if not os.path.isfile(os.path.join(d, COMMON)) and os.path.isfile(
            os.path.join(d, LEGACY_MODEL)):
        return legacy.load(d, rank=rank, world_size=world_size, tp_rank=tp_rank,
                           tp=layout(world_size)["tp"], model=model, optimizer=optimizer,
                           scheduler=scheduler)  # fmt: skip
    path = os.path.join(d, COMMON)
    common = read_torch_file(path, "iteration, data position, scheduler and optimizer settings")
    missing = [k for k in _COMMON_KEYS if k not in common]
    if missing:
        raise CheckpointError(f"{path}: missing entries {missing}")
    if common["iteration"] != it:
        raise CheckpointError(f"{path}: records iteration {common['iteration']}, expected {it} "
                              f"(the directory's); the file is from another checkpoint")
    where = os.path.join(d, SHARDED)
    described = sharded.describe_model(model, writes=False)
    pieces, optim_state = sharded.optimizer_targets(optimizer, described, common["optimizer"],
                                                    where)
    masters = None
    if common["masters"] and any(p.dtype in (torch.float16, torch.bfloat16)
                                 for p in described.params):
        masters = [torch.empty(p.shape, dtype=torch.float32, device=p.device)
                   for p in described.params]  # fmt: skip
        pieces += [pc.like(sharded.MASTER, m) for pc, m in zip(described.of_param, masters)]
    model_pieces = described.pieces
    if common["masters"] and half_dtype(model) is not None:
        # sharded fp32 masters are the parameters: read the saved masters into them,
        # not the half weights they round to
        params = {id(pc) for pc in described.of_param}
        model_pieces = [pc for pc in described.pieces if id(pc) not in params]
        pieces += [pc.like(sharded.MASTER, pc.tensor) for pc in described.of_param]
    sharded.read(where, model_pieces + pieces)
    optimizer.load_state_dict(optim_state)
    scheduler.load_state_dict(common["scheduler"])
    restore_rng(d, rank, common["layout"], layout(world_size))
    extra = dict(common["extra"])
    if masters is not None:
        extra["main_params"] = masters
    return {"iteration": common["iteration"], "consumed_samples": common["consumed_samples"],
            "extra": extra}


def load_weights(root: str, iteration: int, model: torch.nn.Module) -> None:
    """Read only the model's weights of ``iteration`` under ``root`` into ``model``, at
    this process's TP size whatever layout wrote them (the first format: at its own TP
    size). For tools that run the model without its optimizer (``hla-sp generate``);
    collective when the process group has several ranks."""
    d = checkpoint_dir(root, iteration)
    manifest.verify(d, iteration)
    manifest.refuse_non_finite(root, d, iteration)
    if not os.path.isfile(os.path.join(d, COMMON)) and os.path.isfile(
            os.path.join(d, LEGACY_MODEL)):
        tp, _ = sharded.parallel_sizes()
        why = legacy.tp_mismatch(d, tp)
        if why:
            raise CheckpointError(why)
        path = os.path.join(d, f"model_optim_tp{sharded.tp_rank():02d}.pt")
        state = read_torch_file(path, "model weights")
        if "model" not in state:
            raise CheckpointError(f"{path}: no 'model' entry (keys {sorted(state)})")
        try:
            model.load_state_dict(state["model"])
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0]
            raise CheckpointError(f"{path}: the weights do not fit this model ({first})"
                                  ) from None
        return
    sharded.read(os.path.join(d, SHARDED), sharded.describe_model(model, writes=False).pieces)

"""The trainer's components, each built from the config: the data, the model with its
optimizer, the checkpoint manager and the metrics. :class:`hla_sp.launch.train.trainer.Trainer`
assembles them and runs the loop.

The build order is the one the runs' numbers depend on: the data, then
``manual_seed(seed)``, the model (identical initial weights on every rank), its fp32
masters, the loss scaler, AdamW and the scheduler, then ``manual_seed(seed + 1)`` for
the training-time randomness, then the checkpoint to resume.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from hla_sp.launch import checkpoint
from hla_sp.launch.config.train_config import TrainConfig
from hla_sp.launch.data.datasets import config_samples, infer_vocab_size
from hla_sp.launch.distributed.dist_optimizer import local, shard_model
from hla_sp.launch.distributed.process_groups import Topology, parallel_state, tensor_parallel
from hla_sp.launch.model.build import build_model, model_dtype
from hla_sp.launch.model.estimate import model_flops_per_token
from hla_sp.launch.train import metrics
from hla_sp.launch.train.nonfinite import checkpoint_finite, saved_tensors
from hla_sp.launch.train.precision import LossScaler, MasterWeights
from hla_sp.launch.train.throughput import peak_tflops


@dataclass
class TrainData:
    """The training samples, the held-out ones (read only with --eval-interval or
    --skip-train), the global batch in samples and the vocabulary before padding."""

    samples: Any
    valid_samples: Any
    global_batch: int
    vocab: int

    @classmethod
    def build(cls, cfg: TrainConfig, topo: Topology) -> TrainData:
        ev = cfg.evaluation
        return cls(
            samples=config_samples(cfg),
            valid_samples=(config_samples(cfg, "valid")
                           if ev.eval_interval or ev.skip_train else None),
            global_batch=cfg.optimizer.global_batch_size
            or cfg.optimizer.micro_batch_size * topo.dp,
            vocab=cfg.model.vocab_size or infer_vocab_size(cfg.data.data, cfg.data.data_path),
        )


def _param_groups(masters: MasterWeights, weight_decay: float) -> list[dict[str, Any]]:
    """No weight decay on biases and norm weights (1-D), as Megatron does; the groups
    hold the fp32 masters (the model's own parameters in an fp32 run)."""
    decay, no_decay = [], []
    for p, m in zip(masters.params, masters.main):
        (no_decay if p.ndim < 2 else decay).append(m)
    return [
        {"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0},
    ]


@dataclass
class ModelParts:
    """The model, its fp32 masters, the fp16 loss scaler (None otherwise), AdamW and
    Megatron's learning-rate scheduler; the gradient reduction and clipping."""

    model: torch.nn.Module
    masters: MasterWeights
    scaler: LossScaler | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    dp_cp_group: Any
    tp_group: Any
    device: torch.device
    tp: int
    sharded: bool = False  # --use-distributed-optimizer: masters and moments over DP x CP

    @classmethod
    def build(cls, cfg: TrainConfig, vocab: int, topo: Topology) -> ModelParts:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        ps = parallel_state()

        opt, prec = cfg.optimizer, cfg.precision
        # identical initial weights on every rank: Megatron's CPU init draws the whole
        # matrix from the default generator, then keeps this TP rank's slice
        torch.manual_seed(opt.seed)
        # --bf16/--fp16: every floating weight half, norms too (Megatron's Float16Module)
        model = build_model(cfg, vocab, topo.device).to(device=topo.device,
                                                        dtype=model_dtype(cfg))
        dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
        if opt.use_distributed_optimizer:
            shard_model(model, dp_cp, model_dtype(cfg),
                        checkpoint.sharded.unsharded_layout(model))
        masters = MasterWeights(model)
        scaler = (LossScaler(prec.loss_scale, prec.initial_loss_scale, prec.min_loss_scale,
                             prec.loss_scale_window, prec.hysteresis) if prec.fp16 else None)
        optimizer = torch.optim.AdamW(_param_groups(masters, opt.weight_decay), lr=opt.lr,
                                      betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps)
        override = cfg.checkpoint.override_opt_param_scheduler
        scheduler = OptimizerParamScheduler(
            optimizer,
            init_lr=0.0 if opt.lr_warmup_iters else opt.lr,
            max_lr=opt.lr,
            min_lr=opt.min_lr,
            lr_warmup_steps=opt.lr_warmup_iters,
            lr_decay_steps=max(opt.decay_iters, opt.lr_warmup_iters + 1),
            lr_decay_style=opt.lr_decay_style,
            start_wd=opt.weight_decay,
            end_wd=opt.weight_decay,
            wd_incr_steps=max(opt.train_iters, 1),
            wd_incr_style="constant",
            # a changed schedule was refused before the process group unless one of
            # Megatron's two flags says whose to trust; equal values load either way
            override_opt_param_scheduler=override,
            use_checkpoint_opt_param_scheduler=not override,
        )
        return cls(model, masters, scaler, optimizer, scheduler, dp_cp,
                   ps.get_tensor_model_parallel_group(), topo.device, topo.tp,
                   opt.use_distributed_optimizer)

    def all_reduce_grads(self) -> None:
        """Sum the (fp32) gradients over the data-and-context-parallel group (sharded:
        FSDP's reduce-scatter did it in the backward)."""
        if self.sharded or dist.get_world_size(self.dp_cp_group) == 1:
            return
        grads = self.masters.grads()
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.dp_cp_group)
        for g, r in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(r)

    def clip(self, loss_sum: torch.Tensor, clip_grad: float) -> tuple[float, float]:
        """Clip by the global L2 norm; TP-duplicated parameters are counted once. Return
        the norm and ``loss_sum``, read from the device together: the step's one host
        read serves the clip, the non-finite check and the record."""
        param_is_not_tensor_parallel_duplicate = (
            tensor_parallel().param_is_not_tensor_parallel_duplicate)

        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        pairs = list(zip(self.masters.params, self.masters.main))
        for p, m in pairs:
            if m.grad is not None and param_is_not_tensor_parallel_duplicate(p):
                sq += local(m.grad).float().pow(2).sum()
        if self.sharded:  # each DP x CP rank holds its rows of every gradient
            dist.all_reduce(sq, group=self.dp_cp_group)
        if self.tp > 1:
            dist.all_reduce(sq, group=self.tp_group)
        norm, loss = torch.stack([sq.sqrt().double(), loss_sum.reshape(()).to(sq.device)]
                                 ).tolist()
        if clip_grad > 0 and norm > clip_grad:
            scale = clip_grad / (norm + 1e-6)
            for _, m in pairs:
                if m.grad is not None:
                    m.grad.mul_(scale)
        return norm, loss

    def extra_state(self) -> dict[str, Any]:
        """What a checkpoint keeps besides the model and optimizer: masters, scaler."""
        return {**self.masters.state_dict(),
                **({"loss_scaler": self.scaler.state_dict()} if self.scaler else {})}


class CheckpointManager:
    """Resume from --load and save to --save (checkpoint.load / checkpoint.save with
    this run's rank, layout and config)."""

    def __init__(self, cfg: TrainConfig, topo: Topology):
        self.cfg, self.topo = cfg, topo
        ck = cfg.checkpoint
        self.resumed_from = checkpoint.resume_iteration(ck.load, ck.ckpt_step)

    def resume(self, parts: ModelParts) -> tuple[int, int]:
        """Load the checkpoint to resume into ``parts``: (iteration, consumed samples),
        (0, 0) for a fresh start."""
        if self.resumed_from is None:
            return 0, 0
        topo = self.topo
        pos = checkpoint.load(self.cfg.checkpoint.load, rank=topo.rank,
                              world_size=topo.world_size, tp_rank=topo.tp_rank,
                              model=parts.model, optimizer=parts.optimizer,
                              scheduler=parts.scheduler, step=self.resumed_from)
        parts.masters.load_state_dict(pos["extra"])
        if parts.scaler is not None and "loss_scaler" in pos["extra"]:
            parts.scaler.load_state_dict(pos["extra"]["loss_scaler"])
        return pos["iteration"], pos["consumed_samples"]

    def save(self, parts: ModelParts, iteration: int, consumed_samples: int,
             last: dict[str, Any] | None = None) -> str:
        """Write this iteration's checkpoint; ``last`` is its record, whose loss (and
        gradient norm, unless a skipped step) must be finite, like every tensor saved,
        for the checkpoint to count as finite (what --keep-last never deletes and every
        reader requires)."""
        ck, topo = self.cfg.checkpoint, self.topo
        finite = checkpoint_finite(
            saved_tensors(parts.model, parts.masters.main, parts.optimizer), last)
        # the checkpoint this run resumed from stays, when it lives in --save
        same = (ck.load is not None and ck.save is not None and os.path.isdir(ck.load)
                and os.path.isdir(ck.save) and os.path.samefile(ck.load, ck.save))
        return checkpoint.save(
            ck.save,  # type: ignore[arg-type]
            iteration,
            rank=topo.rank,
            world_size=topo.world_size,
            tp_rank=topo.tp_rank,
            writes_model=topo.dp_rank == 0 and topo.cp_rank == 0,
            model=parts.model,
            optimizer=parts.optimizer,
            scheduler=parts.scheduler,
            consumed_samples=consumed_samples,
            config=self.cfg.to_dict(),
            keep_last=ck.keep_last,
            finite=finite,
            loss=(last or {}).get("loss"),
            loaded=self.resumed_from if same else None,
            # the losses: generate's header names the checkpoint's
            extra={**parts.extra_state(), "losses": {
                k: last[k] for k in ("loss", "val_loss") if k in (last or {})}},
        )


class RunMetrics:
    """The throughput model of a step and, on the first rank, the JSONL log, the
    TensorBoard / W&B scalars and the live plot (no-ops on the other ranks)."""

    def __init__(self, cfg: TrainConfig, topo: Topology, data: TrainData):
        self.cfg, self.first = cfg, topo.is_first
        # model FLOPs of one step (recompute not counted): the TFLOP/s of the progress line
        self.flops_per_step = (model_flops_per_token(cfg, data.vocab) * data.global_batch
                               * cfg.model.seq_length)
        self.peak_tflops = peak_tflops(cfg.logging.peak_tflops, topo.device,
                                       cfg.precision.half)

    def open(self, iteration: int, resumed_from: int | None) -> None:
        """Start the run's logs; re-runs and resumes append to the same file."""
        log_jsonl = self.cfg.logging.log_jsonl if self.first else None
        self.log = metrics.JsonlLog(log_jsonl)
        self.log.write(metrics.start_marker(iteration, self.cfg.to_dict(), resumed_from))
        self.scalars = metrics.Scalars(self.cfg if self.first else None)
        self.plot = metrics.LivePlot(log_jsonl)

    def write(self, rec: dict[str, Any],
              on_record: Callable[[dict[str, Any]], None] | None = None) -> None:
        """One iteration's record into the log, ``on_record`` and the scalars; on the
        first rank every --log-interval iterations (and the first) a progress line and
        the plot."""
        self.log.write(rec)
        if on_record is not None:
            on_record(rec)
        self.scalars.write(rec)
        it, every = rec["iteration"], self.cfg.logging.log_interval
        if self.first and (it % every == 0 or it == 1):
            metrics.say(metrics.progress_line(rec, self.cfg.optimizer.train_iters))
            self.plot.draw()

    def close(self) -> None:
        self.log.close()
        self.scalars.close()

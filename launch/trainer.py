"""The trainer's model, optimizer, scheduler, data and step: :class:`Trainer`.

Each optimizer step:

1. every data-parallel replica takes its microbatches of the global batch (full
   sequences), and each context-parallel rank keeps its zigzag share through
   Megatron's ``get_batch_on_this_cp_rank``;
2. the loss is the token mean over the whole global batch: each rank backpropagates
   (its masked loss sum) / (global token count), so summing gradients over the DP x CP
   group gives exactly the single-process gradient;
3. gradients are all-reduced over DP x CP, clipped by the global norm (TP-aware), and
   AdamW steps with Megatron's warmup + cosine scheduler;
4. a non-finite loss or gradient norm stops the run before the optimizer steps, on
   every rank alike (:mod:`hla_sp.launch.nonfinite`); an fp16 overflow stays a skip.

:func:`hla_sp.launch.train.run` builds it inside a process group (under torchrun, and
in each worker of the Ray sweep).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from hla_sp.launch import checkpoint, faults, metrics, signals
from hla_sp.launch.checks import split_weights
from hla_sp.launch.config import TrainConfig
from hla_sp.launch.data import build_samples, infer_vocab_size, microbatches
from hla_sp.launch.distributed import Topology
from hla_sp.launch.nonfinite import NonFiniteError, checkpoint_finite, non_finite, stop_line
from hla_sp.launch.precision import LossScaler, MasterWeights
from hla_sp.launch.throughput import peak_tflops, step_throughput


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


class Trainer:
    """Model, optimizer, scheduler, data and the step; built inside a process group."""

    def __init__(self, cfg: TrainConfig, topo: Topology):
        from hla_sp.launch.model import build_model, model_dtype
        from megatron.core import parallel_state as ps
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.cfg, self.topo = cfg, topo
        self.dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.global_batch = cfg.global_batch_size or cfg.micro_batch_size * topo.dp
        split = split_weights(cfg.split)
        self.samples = build_samples(
            cfg.data, cfg.data_path, cfg.seq_length, cfg.seed, cfg.recall_pairs, split,
            vocab_size=cfg.vocab_size, recall_filler=cfg.recall_filler,
        )
        # the held-out split, read only when --eval-interval asks for validation
        self.valid_samples = (
            build_samples(cfg.data, cfg.data_path, cfg.seq_length, cfg.seed,
                          cfg.recall_pairs, split, part="valid", vocab_size=cfg.vocab_size,
                          recall_filler=cfg.recall_filler)
            if cfg.eval_interval or cfg.skip_train else None
        )
        vocab = cfg.vocab_size or infer_vocab_size(cfg.data, cfg.data_path)
        # identical initial weights on every rank: Megatron's CPU init draws the whole
        # matrix from the default generator, then keeps this TP rank's slice
        torch.manual_seed(cfg.seed)
        # --bf16/--fp16: every floating weight half, norms too (Megatron's Float16Module)
        self.model = build_model(cfg, vocab, topo.device).to(device=topo.device,
                                                             dtype=model_dtype(cfg))
        self.masters = MasterWeights(self.model)
        self.scaler = (
            LossScaler(cfg.loss_scale, cfg.initial_loss_scale, cfg.min_loss_scale,
                       cfg.loss_scale_window, cfg.hysteresis)
            if cfg.fp16 else None
        )
        self.optimizer = torch.optim.AdamW(
            _param_groups(self.masters, cfg.weight_decay),
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
        )
        decay_iters = cfg.lr_decay_iters or cfg.train_iters
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if cfg.lr_warmup_iters else cfg.lr,
            max_lr=cfg.lr,
            min_lr=cfg.min_lr,
            lr_warmup_steps=cfg.lr_warmup_iters,
            lr_decay_steps=max(decay_iters, cfg.lr_warmup_iters + 1),
            lr_decay_style=cfg.lr_decay_style,
            start_wd=cfg.weight_decay,
            end_wd=cfg.weight_decay,
            wd_incr_steps=max(cfg.train_iters, 1),
            wd_incr_style="constant",
            # a changed schedule was refused before the process group unless one of
            # Megatron's two flags says whose to trust; equal values load either way
            override_opt_param_scheduler=cfg.override_opt_param_scheduler,
            use_checkpoint_opt_param_scheduler=not cfg.override_opt_param_scheduler,
        )
        self.iteration = 0
        self.consumed_samples = 0
        # training-time randomness (dropout) starts from a known state on every rank
        torch.manual_seed(cfg.seed + 1)
        self.resumed_from = checkpoint.resume_iteration(cfg.load, cfg.ckpt_step)
        if self.resumed_from is not None:
            pos = checkpoint.load(
                cfg.load,
                rank=topo.rank,
                world_size=topo.world_size,
                tp_rank=topo.tp_rank,
                model=self.model,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                step=self.resumed_from,
            )
            self.iteration, self.consumed_samples = pos["iteration"], pos["consumed_samples"]
            self.masters.load_state_dict(pos["extra"])
            if self.scaler is not None and "loss_scaler" in pos["extra"]:
                self.scaler.load_state_dict(pos["extra"]["loss_scaler"])
        self.rss_before_train = metrics.current_rss_bytes()
        from hla_sp.launch.estimate import model_flops_per_token

        # model FLOPs of one step (recompute not counted): the TFLOP/s of the progress line
        self.flops_per_step = (model_flops_per_token(cfg, vocab) * self.global_batch
                               * cfg.seq_length)
        self.peak_tflops = peak_tflops(cfg.peak_tflops, topo.device, cfg.bf16 or cfg.fp16)
        self.stopped_by: int | None = None  # the signal that ended the run early, if any

    # -- one optimizer step ---------------------------------------------------------
    def _cp_slice(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from megatron.core.utils import get_batch_on_this_cp_rank

        batch = {k: v.to(self.topo.device) for k, v in batch.items()}
        return get_batch_on_this_cp_rank(batch)

    def _all_reduce_grads(self) -> None:
        """Sum the (fp32) gradients over the data-and-context-parallel group."""
        if dist.get_world_size(self.dp_cp_group) == 1:
            return
        grads = self.masters.grads()
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.dp_cp_group)
        for g, r in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(r)

    def _clip(self, loss_sum: torch.Tensor) -> tuple[float, float]:
        """Clip by the global L2 norm; TP-duplicated parameters are counted once. Return
        the norm and ``loss_sum``, read from the device together: the step's one host
        read serves the clip, the non-finite check and the record."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        sq = torch.zeros((), dtype=torch.float32, device=self.topo.device)
        pairs = list(zip(self.masters.params, self.masters.main))
        for p, m in pairs:
            if m.grad is not None and param_is_not_tensor_parallel_duplicate(p):
                sq += m.grad.float().pow(2).sum()
        if self.topo.tp > 1:
            dist.all_reduce(sq, group=self.tp_group)
        norm, loss = torch.stack([sq.sqrt().double(), loss_sum.reshape(()).to(sq.device)]
                                 ).tolist()
        if self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad:
            scale = self.cfg.clip_grad / (norm + 1e-6)
            for _, m in pairs:
                if m.grad is not None:
                    m.grad.mul_(scale)
        return norm, loss

    def _batches(self, samples: Any, consumed: int) -> list[dict[str, torch.Tensor]]:
        """This rank's CP share of its microbatches of the global batch at ``consumed``."""
        return [
            self._cp_slice(b)
            for b in microbatches(samples, consumed, self.global_batch,
                                  self.cfg.micro_batch_size, self.topo.dp_rank, self.topo.dp)
        ]

    def evaluate(self) -> dict[str, float]:
        """Token-mean loss over --eval-iters global batches of the held-out split (the
        same batches at every evaluation, so the values form a curve): ``val_loss``, and
        for --data synthetic-recall ``val_recall_acc``, the share of queried values the
        model predicts (argmax) at the labelled positions."""
        assert self.valid_samples is not None
        recall = self.cfg.data == "synthetic-recall"
        self.model.eval()
        total = torch.zeros(4, dtype=torch.float64, device=self.topo.device)
        with torch.no_grad():
            for i in range(self.cfg.eval_iters):
                for b in self._batches(self.valid_samples, i * self.global_batch):
                    per_token = self.model(b["tokens"], b["position_ids"], None,
                                           labels=b["labels"])
                    total[0] += (per_token.float() * b["loss_mask"]).sum().double()
                    total[1] += b["loss_mask"].sum().double()
                    if recall:
                        hit = self._predicted(b) == b["labels"]
                        total[2] += (hit.double() * b["loss_mask"]).sum()
        dist.all_reduce(total, group=self.dp_cp_group)
        self.model.train()
        out = {"val_loss": float(total[0] / total[1].clamp(min=1.0))}
        if recall:
            out["val_recall_acc"] = float(total[2] / total[1].clamp(min=1.0))
        return out

    def evaluate_checkpoint(self) -> dict[str, Any]:
        """--skip-train: evaluate the loaded weights once. The record goes to --log-jsonl
        as an ``"evaluation"`` event, which readers of the iteration records skip, so a
        training run's log can take it without losing the iteration it names."""
        rec = {"event": "evaluation", "iteration": self.iteration, "load": self.cfg.load,
               "time": time.time(), "samples_per_batch": self.global_batch,
               "cp": self.topo.cp, "tp": self.topo.tp, "dp": self.topo.dp,
               **self.evaluate()}
        log = metrics.JsonlLog(self.cfg.log_jsonl if self.topo.is_first else None)
        try:
            log.write(rec)
        finally:
            log.close()
        return rec

    def _predicted(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        """The argmax token at every position [b, s_local]; logits are vocab-parallel
        under TP, so the shards are gathered first."""
        from megatron.core import tensor_parallel

        logits = self.model(b["tokens"], b["position_ids"], None)  # [b, s, vocab / TP]
        if self.topo.tp > 1:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        return logits.argmax(-1)

    def step(self) -> dict[str, Any]:
        """Train one global batch; return the iteration's record (loss reduced globally)."""
        cfg, topo = self.cfg, self.topo
        faults.maybe_inject(topo.rank, self.iteration + 1)
        t0 = time.perf_counter()
        self.model.train()
        batches = self._batches(self.samples, self.consumed_samples)
        # the denominator of the token mean over the whole global batch
        count = torch.stack([b["loss_mask"].sum() for b in batches]).sum().reshape(1).double()
        dist.all_reduce(count, group=self.dp_cp_group)
        total_tokens = float(count.item())
        self.masters.zero_grad()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        loss_sum = torch.zeros(1, dtype=torch.float64, device=topo.device)
        for b in batches:
            per_token = self.model(
                b["tokens"], b["position_ids"], None, labels=b["labels"]
            )  # [b, s_local]
            local = (per_token.float() * b["loss_mask"]).sum()
            (local * (scale / max(total_tokens, 1.0))).backward()
            self.masters.accumulate()  # half grads into fp32 ones, microbatch by microbatch
            loss_sum += local.detach().double()
        self._all_reduce_grads()
        dist.all_reduce(loss_sum, group=self.dp_cp_group)
        skipped = False
        if self.scaler is not None:
            skipped = self.masters.unscale_and_check(scale)
            self.scaler.update(skipped)
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this step used
        if skipped:  # fp16 overflow: no update, and the schedule waits (as Megatron)
            grad_norm, loss_total = float("nan"), float(loss_sum.item())
        else:
            grad_norm, loss_total = self._clip(loss_sum)
        loss = loss_total / max(total_tokens, 1.0)
        bad = non_finite(loss, grad_norm, skipped) if cfg.check_for_nan_in_loss_and_grad else ""
        if bad:
            raise NonFiniteError(stop_line(cfg, self.iteration, self.resumed_from, bad))
        if not skipped:
            self.optimizer.step()
            self.masters.copy_to_model()
            self.scheduler.step(1)
        if topo.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        self.iteration += 1
        self.consumed_samples += self.global_batch
        peaks = torch.tensor([metrics.peak_memory_bytes()], dtype=torch.int64)
        gathered = [torch.zeros_like(peaks) for _ in range(topo.world_size)]
        dist.all_gather(gathered, peaks.to(topo.device) if topo.device.type == "cuda" else peaks)
        per_rank = [int(g.item()) for g in gathered]
        tokens = self.global_batch * cfg.seq_length
        return {
            "iteration": self.iteration,
            "consumed_tokens": self.consumed_samples * cfg.seq_length,
            **step_throughput(self.flops_per_step, tokens, dt, topo.world_size,
                              self.peak_tflops),
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": tokens,
            "step_time_s": dt,
            "peak_mem_bytes": max(per_rank),
            "peak_mem_bytes_per_rank": per_rank,
            "seq_length": cfg.seq_length,
            "cp": topo.cp,
            "tp": topo.tp,
            "dp": topo.dp,
            "world_size": topo.world_size,
            "attention": cfg.attention,
            **({"loss_scale": scale, "skipped": skipped} if self.scaler is not None else {}),
        }

    def save(self, last: dict[str, Any] | None = None) -> str:
        """Write this iteration's checkpoint; ``last`` is its record, whose loss (and
        gradient norm, unless an fp16 skip) must be finite, like the weights, for the
        checkpoint to count as finite (what --keep-last never deletes)."""
        cfg = self.cfg
        finite = checkpoint_finite(self.masters.main, last)
        # the checkpoint this run resumed from stays, when it lives in --save
        same = (cfg.load is not None and cfg.save is not None and os.path.isdir(cfg.load)
                and os.path.isdir(cfg.save) and os.path.samefile(cfg.load, cfg.save))
        return checkpoint.save(
            self.cfg.save,  # type: ignore[arg-type]
            self.iteration,
            rank=self.topo.rank,
            world_size=self.topo.world_size,
            tp_rank=self.topo.tp_rank,
            writes_model=self.topo.dp_rank == 0 and self.topo.cp_rank == 0,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            consumed_samples=self.consumed_samples,
            config=self.cfg.to_dict(),
            keep_last=self.cfg.keep_last,
            finite=finite,
            loaded=self.resumed_from if same else None,
            extra={
                **self.masters.state_dict(),
                **({"loss_scaler": self.scaler.state_dict()} if self.scaler else {}),
                "losses": {k: last[k] for k in ("loss", "val_loss") if k in (last or {})},
            },
        )

    # -- the loop -------------------------------------------------------------------
    def train(
        self,
        on_record: Callable[[dict[str, Any]], None] | None = None,
        heartbeat: faults.Heartbeat | None = None,
    ) -> list[dict[str, Any]]:
        """Step until --train-iters (or --exit-interval); log, save; return the records."""
        cfg, first = self.cfg, self.topo.is_first
        log = metrics.JsonlLog(cfg.log_jsonl if first else None)
        # where this run begins: re-runs and resumes append to the same file
        log.write(metrics.start_marker(self.iteration, cfg.to_dict(), self.resumed_from))
        records = []
        scalars = metrics.Scalars(cfg if first else None)
        plot = metrics.LivePlot(cfg.log_jsonl if first else None)
        start, start_iter = time.perf_counter(), self.iteration
        try:
            while self.iteration < cfg.train_iters:
                rec = self.step()
                # elapsed since this launch, and the rest at this launch's mean pace
                rec["elapsed_s"] = time.perf_counter() - start
                rec["eta_s"] = (rec["elapsed_s"] / (self.iteration - start_iter)
                                * (cfg.train_iters - self.iteration))
                last = self.iteration >= cfg.train_iters or (
                    cfg.exit_interval is not None and self.iteration % cfg.exit_interval == 0
                )
                if cfg.eval_interval and (self.iteration % cfg.eval_interval == 0 or last):
                    rec.update(self.evaluate())
                records.append(rec)
                if heartbeat is not None:
                    heartbeat.progress(self.iteration)
                log.write(rec)
                if on_record is not None:
                    on_record(rec)
                scalars.write(rec)
                if first and (self.iteration % cfg.log_interval == 0 or self.iteration == 1):
                    metrics.say(metrics.progress_line(rec, cfg.train_iters))
                    plot.draw()
                done = self.iteration >= cfg.train_iters
                stop = cfg.exit_interval is not None and self.iteration % cfg.exit_interval == 0
                periodic = cfg.save_interval is not None and self.iteration % cfg.save_interval == 0
                # --exit-signal-handler: every rank stops after the same iteration
                signalled = signals.agreed(self.topo.device) if cfg.exit_signal_handler else 0
                if cfg.save and (done or stop or periodic or signalled):
                    path = self.save(rec)
                    if first:
                        metrics.say(f"saved checkpoint {path}")
                if signalled and not done:
                    self.stopped_by = signalled
                    break
                if stop and not done:
                    if first:
                        metrics.say(
                            f"--exit-interval {cfg.exit_interval}: stopping at {self.iteration}"
                        )
                    break
        finally:
            log.close()
            scalars.close()
        return records

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
   every rank alike (:mod:`hla_sp.launch.train.nonfinite`); an fp16 overflow stays a skip,
   and so is such a step under --no-check-for-nan-in-loss-and-grad.

:func:`hla_sp.launch.train.main.run` builds it inside a process group (under torchrun, and
in each worker of the Ray sweep).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from hla_sp.launch.config.train_config import TrainConfig
from hla_sp.launch.data.datasets import microbatches
from hla_sp.launch.distributed import drills, faults, signals
from hla_sp.launch.distributed.process_groups import Topology, tensor_parallel
from hla_sp.launch.model.loss import masked_loss_sum, token_losses
from hla_sp.launch.train import metrics
from hla_sp.launch.train.components import CheckpointManager, ModelParts, RunMetrics, TrainData
from hla_sp.launch.train.nonfinite import NonFiniteError, non_finite, stop_line
from hla_sp.launch.train.profiling import StepProfiler
from hla_sp.launch.train.throughput import step_throughput
from hla_sp.megatron_patch.compat import cp_split


class Trainer:
    """The loop over the components (data, model and optimizer, checkpoints, metrics,
    :mod:`hla_sp.launch.train.components`); built inside a process group."""

    def __init__(self, cfg: TrainConfig, topo: Topology):
        self.cfg, self.topo = cfg, topo
        self.data = TrainData.build(cfg, topo)
        self.parts = ModelParts.build(cfg, self.data.vocab, topo)
        self.model, self.masters, self.scaler = (self.parts.model, self.parts.masters,
                                                 self.parts.scaler)
        self.optimizer, self.scheduler = self.parts.optimizer, self.parts.scheduler
        self.dp_cp_group = self.parts.dp_cp_group
        # training-time randomness (dropout) starts from a known state on every rank
        torch.manual_seed(cfg.optimizer.seed + 1)
        self.checkpoints = CheckpointManager(cfg, topo)
        self.resumed_from = self.checkpoints.resumed_from
        self.iteration, self.consumed_samples = self.checkpoints.resume(self.parts)
        self.metrics = RunMetrics(cfg, topo, self.data)
        self.stopped_by: int | None = None  # the signal that ended the run early, if any

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self.data.global_batch

    # -- one optimizer step ---------------------------------------------------------
    def _cp_slice(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        batch = {k: v.to(self.topo.device) for k, v in batch.items()}
        return cp_split(batch, self.topo.cp_group)

    def _batches(self, samples: Any, consumed: int) -> list[dict[str, torch.Tensor]]:
        """This rank's CP share of its microbatches of the global batch at ``consumed``."""
        return [
            self._cp_slice(b)
            for b in microbatches(samples, consumed, self.global_batch,
                                  self.cfg.optimizer.micro_batch_size, self.topo.dp_rank,
                                  self.topo.dp)
        ]

    def evaluate(self) -> dict[str, float]:
        """Token-mean loss over --eval-iters global batches of the held-out split (the
        same batches at every evaluation, so the values form a curve): ``val_loss``, and
        for --data synthetic-recall ``val_recall_acc``, the share of queried values the
        model predicts (argmax) at the labelled positions."""
        assert self.data.valid_samples is not None
        recall = self.cfg.data.data == "synthetic-recall"
        self.model.eval()
        total = torch.zeros(4, dtype=torch.float64, device=self.topo.device)
        with torch.no_grad():
            for i in range(self.cfg.evaluation.eval_iters):
                for b in self._batches(self.data.valid_samples, i * self.global_batch):
                    per_token = token_losses(self.model, b)
                    total[0] += masked_loss_sum(per_token, b["loss_mask"]).double()
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
        rec = {"event": "evaluation", "iteration": self.iteration, "load": self.cfg.checkpoint.load,
               "time": time.time(), "samples_per_batch": self.global_batch,
               "cp": self.topo.cp, "tp": self.topo.tp, "dp": self.topo.dp,
               **self.evaluate()}
        log = metrics.JsonlLog(self.cfg.logging.log_jsonl if self.topo.is_first else None)
        try:
            log.write(rec)
        finally:
            log.close()
        return rec

    def _predicted(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        """The argmax token at every position [b, s_local]; logits are vocab-parallel
        under TP, so the shards are gathered first."""
        logits = self.model(b["tokens"], b["position_ids"], None)  # [b, s, vocab / TP]
        if self.topo.tp > 1:
            logits = tensor_parallel().gather_from_tensor_model_parallel_region(logits)
        return logits.argmax(-1)

    def step(self) -> dict[str, Any]:
        """Train one global batch; return the iteration's record (loss reduced globally)."""
        cfg, topo = self.cfg, self.topo
        drills.maybe_inject(topo.rank, self.iteration + 1)
        t0 = time.perf_counter()
        self.model.train()
        batches = self._batches(self.data.samples, self.consumed_samples)
        # the denominator of the token mean over the whole global batch
        count = torch.stack([b["loss_mask"].sum() for b in batches]).sum().reshape(1).double()
        dist.all_reduce(count, group=self.dp_cp_group)
        total_tokens = float(count.item())
        self.masters.zero_grad()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        loss_sum = torch.zeros(1, dtype=torch.float64, device=topo.device)
        for b in batches:
            local = masked_loss_sum(token_losses(self.model, b), b["loss_mask"])
            (local * (scale / max(total_tokens, 1.0))).backward()
            self.masters.accumulate()  # half grads into fp32 ones, microbatch by microbatch
            loss_sum += local.detach().double()
        self.parts.all_reduce_grads()
        dist.all_reduce(loss_sum, group=self.dp_cp_group)
        skipped = False
        if self.scaler is not None:
            skipped = self.masters.unscale_and_check(scale)
            self.scaler.update(skipped)
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this step used
        if skipped:  # fp16 overflow: no update, and the schedule waits (as Megatron)
            grad_norm, loss_total = float("nan"), float(loss_sum.item())
        else:
            grad_norm, loss_total = self.parts.clip(loss_sum, cfg.optimizer.clip_grad)
        loss = loss_total / max(total_tokens, 1.0)
        bad = non_finite(loss, grad_norm, skipped)
        if bad and cfg.optimizer.check_for_nan_in_loss_and_grad:
            raise NonFiniteError(stop_line(cfg, self.iteration, self.resumed_from, bad))
        skipped = skipped or bool(bad)  # the opt-out trains on: no non-finite update
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
        tokens = self.global_batch * cfg.model.seq_length
        return {
            "iteration": self.iteration,
            "consumed_tokens": self.consumed_samples * cfg.model.seq_length,
            **step_throughput(self.metrics.flops_per_step, tokens, dt, topo.world_size,
                              self.metrics.peak_tflops),
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": tokens,
            "step_time_s": dt,
            "peak_mem_bytes": max(per_rank),
            "peak_mem_bytes_per_rank": per_rank,
            "seq_length": cfg.model.seq_length,
            "cp": topo.cp,
            "tp": topo.tp,
            "dp": topo.dp,
            "world_size": topo.world_size,
            "attention": cfg.model.attention,
            **({"loss_scale": scale} if self.scaler is not None else {}),
            **({"skipped": skipped} if self.scaler is not None or skipped else {}),
        }

    def save(self, last: dict[str, Any] | None = None) -> str:
        """Write this iteration's checkpoint (``last``: its record, see
        :meth:`CheckpointManager.save`)."""
        return self.checkpoints.save(self.parts, self.iteration, self.consumed_samples, last)

    # -- the loop -------------------------------------------------------------------
    def train(
        self,
        on_record: Callable[[dict[str, Any]], None] | None = None,
        heartbeat: faults.Heartbeat | None = None,
    ) -> list[dict[str, Any]]:
        """Step until --train-iters (or --exit-interval); log, save; return the records."""
        cfg, first = self.cfg, self.topo.is_first
        ck, iters, ev = cfg.checkpoint, cfg.optimizer.train_iters, cfg.evaluation.eval_interval
        # where this run begins: re-runs and resumes append to the same file
        self.metrics.open(self.iteration, self.resumed_from)
        records = []
        start, start_iter = time.perf_counter(), self.iteration
        profiler = StepProfiler(cfg, self.topo, self.iteration, self.model)  # --profile
        try:
            profiler.start()
            while self.iteration < iters:
                rec = self.step()
                it = self.iteration
                # elapsed since this launch, and the rest at this launch's mean pace
                rec["elapsed_s"] = time.perf_counter() - start
                rec["eta_s"] = rec["elapsed_s"] / (it - start_iter) * (iters - it)
                done = it >= iters
                stop = ck.exit_interval is not None and it % ck.exit_interval == 0
                if ev and (it % ev == 0 or done or stop):
                    rec.update(self.evaluate())
                records.append(rec)
                if heartbeat is not None:
                    heartbeat.progress(it)
                self.metrics.write(rec, on_record)
                profiler.step()
                periodic = ck.save_interval is not None and it % ck.save_interval == 0
                # --exit-signal-handler: every rank stops after the same iteration
                signalled = signals.agreed(self.topo.device) if ck.exit_signal_handler else 0
                if ck.save and (done or stop or periodic or signalled):
                    path = self.save(rec)
                    if first:
                        metrics.say(f"saved checkpoint {path}")
                if signalled and not done:
                    self.stopped_by = signalled
                    break
                if stop and not done:
                    if first:
                        metrics.say(f"--exit-interval {ck.exit_interval}: stopping at {it}")
                    break
        finally:
            profiler.stop()
            self.metrics.close()
        return records

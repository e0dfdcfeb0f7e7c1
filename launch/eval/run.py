"""The workers of ``hla-sp eval``: ``torchrun -m hla_sp.launch.eval.run <eval flags>``.

Every rank builds the same sequences (:mod:`hla_sp.launch.eval.tasks`), keeps its
zigzag share (Megatron's ``get_batch_on_this_cp_rank``: chunks r and 2P-1-r of 2P) with
the global position of each token, and runs the model forward without gradients; the
figures are sums over the positions a rank holds, added up across the ranks in float64.
So the result does not depend on P beyond the rounding of the model's own sums.

* ``ppl-by-position``: the loss at position t is that of predicting token t+1 from
  tokens 0..t; summed per bucket over the windows, then divided by the bucket's count.
* ``passkey``: the key's tokens are the last labels of the sequence; a sample is
  retrieved when the argmax at every one of them is the key's token (teacher forcing:
  one forward), and its log-prob is the mean over the key's tokens.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

# Megatron warns on import about apex/TE; on CPU that is the expected state
warnings.filterwarnings("ignore", message=".*(Apex|apex|Transformer Engine|full scope).*")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hla_sp.launch import checkpoint, errors  # noqa: E402
from hla_sp.launch.data.datasets import BYTE_VOCAB  # noqa: E402
from hla_sp.launch.distributed import drills, faults  # noqa: E402
from hla_sp.launch.distributed.process_groups import (  # noqa: E402
    Topology,
    init_distributed,
    parallel_state,
    shutdown,
)
from hla_sp.launch.errors import ConfigError  # noqa: E402
from hla_sp.launch.eval import report as eval_report  # noqa: E402
from hla_sp.launch.eval.command import Plan, build_parser, make_plan, prepare_output  # noqa: E402
from hla_sp.launch.eval.tasks import bucket_of, buckets, passkey, short  # noqa: E402
from hla_sp.launch.model.build import build_model, model_dtype  # noqa: E402
from hla_sp.launch.model.loss import token_losses  # noqa: E402
from hla_sp.launch.progress import Progress  # noqa: E402
from hla_sp.launch.train import metrics  # noqa: E402
from hla_sp.megatron_patch.compat import cp_split  # noqa: E402

PROG = "hla-sp eval"


def _local(tokens: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's share of one sequence of ``length + 1`` tokens: inputs, labels and
    global positions [1, length / P] each."""
    x = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64)).to(device)
    n = x.numel() - 1
    return cp_split({
        "tokens": x[None, :-1], "labels": x[None, 1:],
        "position_ids": torch.arange(n, device=device)[None]},
        parallel_state().get_context_parallel_group())


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed in place over the ranks (every rank holds the whole result)."""
    if dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def ppl_length(model: torch.nn.Module, plan: Plan, length: int, device: torch.device,
               tick: Callable[[int], None] = lambda n: None) -> dict[str, Any]:
    """Loss per position bucket at ``length``, over --samples windows (``tick(length)``
    after each)."""
    first = plan.args.first_bucket
    edges = buckets(length, first)
    total = torch.zeros(2, len(edges), dtype=torch.float64, device=device)  # sum, count
    per_sample = []
    for i in range(plan.args.samples):
        b = _local(plan.data.window(i, length), device)
        loss = token_losses(model, b)[0]  # [s_local]
        which = bucket_of(b["position_ids"][0], first)
        part = torch.zeros_like(total)
        part[0].index_add_(0, which, loss.double())
        part[1].index_add_(0, which, torch.ones_like(loss, dtype=torch.float64))
        _sum_over_ranks(part)
        total += part
        per_sample.append(float(part[0].sum() / length))
        tick(length)
    sums, counts = total.tolist()
    rows = [{"lo": lo, "hi": hi, "tokens": int(c), "loss_nats": s / c,
             "bits_per_token": s / c / math.log(2)}
            for (lo, hi), s, c in zip(edges, sums, counts)]
    mean = sum(sums) / sum(counts)
    return {"loss_nats": mean, "bits_per_token": mean / math.log(2), "buckets": rows,
            "sample_loss_nats": per_sample}


def key_stats(logits: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor,
              first: int) -> torch.Tensor:
    """[log-prob sum, argmax hits, count] (float64) over this rank's positions >= ``first``
    (the key's labels): ``logits`` [s_local, vocab], ``labels`` and ``positions``
    [s_local] (global positions, in the rank's zigzag order)."""
    at = positions >= first
    rows = logits[at].double()
    want = labels[at]
    logp = torch.log_softmax(rows, -1).gather(-1, want[:, None])[:, 0]
    hits = (rows.argmax(-1) == want).double().sum()
    return torch.stack([logp.sum(), hits, at.sum().double()])


def passkey_length(model: torch.nn.Module, plan: Plan, length: int, device: torch.device,
                   tick: Callable[[int], None] = lambda n: None) -> dict[str, Any]:
    """Retrieval at each --depths, --samples seeded sequences each (``tick(length)``
    after each sequence)."""
    rows = []
    for d, depth in enumerate(plan.depths):
        hits, logps, samples = 0, [], []
        for i in range(plan.args.samples):
            pk = passkey(plan.data, length, depth, plan.args.seed, d, i)
            b = _local(pk.tokens, device)
            logits = model(b["tokens"], b["position_ids"], None)[0]  # [s_local, vocab]
            lp_sum, right, seen = _sum_over_ranks(key_stats(
                logits, b["labels"][0], b["position_ids"][0], length - pk.answer_tokens)
            ).tolist()
            assert int(seen) == pk.answer_tokens, (seen, pk.answer_tokens)
            ok = int(right) == pk.answer_tokens
            hits += ok
            logps.append(lp_sum / pk.answer_tokens)
            samples.append({"key": pk.key, "needle_at": pk.needle_at, "retrieved": ok,
                            "digit_logprob": lp_sum / pk.answer_tokens})
            tick(length)
        rows.append({"depth": depth, "accuracy": hits / len(samples),
                     "digit_logprob": sum(logps) / len(logps), "samples": samples})
    return {"accuracy": sum(r["accuracy"] for r in rows) / len(rows), "depths": rows}


def load_model(plan: Plan, topo: Topology) -> torch.nn.Module:
    """The checkpoint's GPTModel at this CP size, weights read from its pieces, eval mode."""

    cfg = plan.cfg
    torch.manual_seed(cfg.optimizer.seed)  # the weights are overwritten; this keeps the build quiet
    model = build_model(cfg, cfg.model.vocab_size or BYTE_VOCAB, topo.device)
    model = model.to(device=topo.device, dtype=model_dtype(cfg))
    checkpoint.load_weights(plan.args.load, plan.iteration, model)
    return model.eval()


def _warm_up(model: torch.nn.Module, plan: Plan, device: torch.device) -> None:
    """One short untimed forward: the first one pays for lazy set-up (kernels chosen,
    buffers allocated), which would otherwise land on the first length's cost."""
    n = min(min(plan.lengths), 128 * plan.cp)  # both divisible by 2 x CP
    b = _local(np.zeros(n + 1, dtype=np.int64), device)
    with torch.no_grad():
        model(b["tokens"], b["position_ids"], None)


def evaluate(plan: Plan, topo: Topology) -> dict[str, Any]:
    """Every length in turn; rank 0 writes the record after each (a long run keeps what
    it measured) and the plot at the end."""
    t0 = time.perf_counter()
    model = load_model(plan, topo)
    record = eval_report.header(plan, topo, os.environ.get(
        "HLA_SP_EVAL_COMMAND", " ".join(["hla-sp", "eval", *sys.argv[1:]])))
    record["timing"]["load_s"] = time.perf_counter() - t0
    run = ppl_length if plan.args.task == "ppl-by-position" else passkey_length
    _warm_up(model, plan, topo.device)
    per_length = plan.args.samples * (len(plan.depths) if run is passkey_length else 1)
    bar = Progress(f"eval {plan.args.task}", sum(plan.lengths) * per_length, "tokens",
                   enabled=topo.is_first)
    for i, length in enumerate(plan.lengths):
        drills.maybe_inject(topo.rank, i + 1)  # HLA_SP_FAULT drills: ITER is the i-th length
        metrics.reset_peak_memory()
        dist.barrier()
        start = time.perf_counter()
        tick = functools.partial(bar.advance, note=f"at {short(length)}")
        with torch.no_grad():
            out = run(model, plan, length, topo.device, tick)
        if topo.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        seconds = time.perf_counter() - start
        peaks = torch.tensor([metrics.peak_memory_bytes()], dtype=torch.float64,
                             device=topo.device)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        tokens = length * plan.args.samples * (len(plan.depths) if run is passkey_length
                                               else 1)
        out = {"length": length, "tokens": tokens, "seconds": seconds,
               "seconds_per_1k_tokens": seconds / tokens * 1000,
               "peak_mem_bytes": int(peaks.item()), **out}
        record["results"].append(out)
        record["timing"]["total_s"] = time.perf_counter() - t0
        if topo.is_first:
            eval_report.write_json(plan, record)
            bar.say(eval_report.line(plan, out))
    bar.close()
    if topo.is_first:
        for msg in eval_report.finish(plan, record):
            metrics.say(msg)
    return record


def _stop(signum: int, frame: Any) -> None:
    """Ctrl-C or SIGTERM (torchrun passes it to every worker): one line from rank 0, no
    traceback from each rank; the JSON keeps the lengths already measured."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"{PROG}: stopped by {signal.Signals(signum).name}; the JSON in --output "
                    f"holds the lengths finished before it\n".encode())
    os._exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """One worker: plan (the launcher's checks again), join the group, evaluate."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop)
    args = build_parser().parse_args(argv)
    topo = None
    try:
        plan = make_plan(args)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != plan.cp:
            raise ConfigError(f"--nproc-per-node: expected the world size {world} (as "
                              f"torchrun started it), got {plan.cp}")
        prepare_output(args)
        topo = init_distributed(1, plan.cp, args.distributed_timeout_minutes)
        evaluate(plan, topo)
    except Exception as err:
        known = faults.known_error(err)
        if known is not None:
            faults.report_known(known, PROG)  # once for the run, by the launcher
        elif errors.reporting():  # hla-sp eval's launcher prints one traceback for the run
            faults.report_failure(faults.global_rank(), int(os.environ.get("WORLD_SIZE", "1")),
                                  err, with_traceback=True, doing="evaluation")
        else:
            raise
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2 if known is not None else 1)  # a broken group can hang in its teardown
    shutdown(topo)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a run will cost before it starts: parameters, memory per rank, model FLOPs.

The memory model is the one ``docs/launch.md`` ("The memory model") gives, fitted to
the CPU measurements of ``benchmarks/bench_long_context.py`` and checked against the
1,048,576-token CP=4 run:

    memory per rank = fixed + bytes per parameter x parameters on the rank
                      + tokens on the rank x activation bytes per token

- fixed: 0.48 GiB (interpreter, torch and megatron; measured);
- bytes per parameter: 16 in fp32 (weight, gradient, AdamW's two moments), 20 with
  --bf16/--fp16 (half weight and gradient, fp32 master weight, its gradient, moments);
  with --use-distributed-optimizer the fp32 master, its gradient and the moments (16
  bytes) divide over DP x CP and the step's whole weight and gradient stay: 4 + 16 /
  (DP x CP) with --bf16/--fp16, 8 + 16 / (DP x CP) in fp32;
- tokens on the rank: micro-batch size x seq-length / CP;
- activation bytes per token: every layer's saved input (``e`` x hidden with full
  recompute, 17 ``e`` x hidden otherwise, Korthikanti et al.'s per-layer figure without
  softmax's T^2 term, which HLA does not have), plus the larger of one layer's working
  set in backward (173 x hidden x ``e``/4; measured: 181 B per token per unit of width
  for 2 layers at full recompute, less their saved inputs) and the logits' (12 bytes per
  vocabulary entry on the TP rank: fp32 logits, softmax and gradient). ``e`` is the
  bytes of one element: 4 in fp32, 2 in bf16/fp16. With --loss-chunk-tokens C (on by
  default above 4096 tokens per rank) the logits' term is C tokens', not every token's.

It is an estimate: within a few percent of the measured CPU runs at full recompute,
and an upper bound without recompute (Megatron's figure assumes nothing is fused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hla_sp.launch.errors import ConfigError

if TYPE_CHECKING:
    from hla_sp.launch.config.train_config import TrainConfig

GIB = 2**30
FIXED_BYTES = int(0.48 * GIB)
WORKING_SET_PER_WIDTH = 173  # bytes per token per unit of hidden size, fp32
SAVED_ELEMENTS_FULL = 1  # hidden-size elements per token per layer, full recompute
SAVED_ELEMENTS = 17  # ... without (or with selective) recompute
LOGIT_BYTES = 12  # per token per vocabulary entry on the TP rank
BYTE_VOCAB = 257  # the built-in data's vocabulary (256 bytes and EOD)


def _padded(vocab: int, divisible_by: int, tp: int) -> int:
    m = divisible_by * tp
    return (vocab + m - 1) // m * m


@dataclass(frozen=True)
class Estimate:
    """Parameters (whole model and per TP rank), memory per rank and model FLOPs."""

    embedding: int
    position_table: int
    per_layer: int
    layers: int
    final_norm: int
    params_per_rank: int
    tokens_per_rank: int
    state_bytes: int
    activation_bytes: int
    flops_per_step: float

    @property
    def total(self) -> int:
        return self.embedding + self.position_table + self.layers + self.final_norm

    @property
    def memory_bytes(self) -> int:
        return FIXED_BYTES + self.state_bytes + self.activation_bytes


def _element_bytes(cfg: TrainConfig) -> int:
    return 2 if cfg.precision.bf16 or cfg.precision.fp16 else 4


def _layer_params(cfg: TrainConfig, tp: int = 1) -> int:
    """One transformer layer's parameters on a TP rank (Megatron's local layer: LayerNorm
    with bias, fused QKV, GeLU MLP, biases on), plus HLA's small per-head extras."""
    h, heads = cfg.model.hidden_size, cfg.model.num_attention_heads
    d = h // heads
    groups = cfg.model.num_query_groups or heads
    qkv = h + 2 * groups * d
    ffn = cfg.model.ffn_hidden_size or 4 * h
    matrices = (h * qkv + qkv + h * h + h * ffn + ffn + ffn * h) // tp
    replicated = h + h + 4 * h  # row-parallel biases (proj, fc2), two LayerNorms
    hla = 0
    if cfg.model.attention != "softmax":
        taps = int(cfg.hla.short_conv or 0)
        hla = (taps * qkv + heads * d + 2 * heads) // tp  # conv, output norm, decay, mix
    return matrices + replicated + hla


def _vocab(cfg: TrainConfig, vocab: int | None) -> int:
    v = vocab or cfg.model.vocab_size or BYTE_VOCAB
    return _padded(v, cfg.model.make_vocab_size_divisible_by,
                   cfg.parallelism.tensor_model_parallel_size)


def model_flops_per_token(cfg: TrainConfig, vocab: int | None = None) -> float:
    """Training FLOPs per token (forward and backward, 3x the forward; recomputation not
    counted, as in MFU): :func:`hla_sp.launch.model.flops.gpt_flops_per_token` of the run's
    shape, its core attention counted as it computes (HLA's chunked passes, or softmax's
    causal scores and mixing)."""
    from hla_sp.launch.model.flops import gpt_flops_per_token

    m = cfg.model
    return gpt_flops_per_token(
        layers=m.num_layers, hidden=m.hidden_size, heads=m.num_attention_heads,
        kv_heads=m.num_query_groups or m.num_attention_heads,
        ffn=m.ffn_hidden_size or 4 * m.hidden_size, vocab=_vocab(cfg, vocab),
        seq_length=m.seq_length, attention=m.attention, chunk=cfg.hla.chunk_size)


AUTO_LOSS_CHUNK = 4096  # tokens: large enough for efficient matmuls, logits a few GiB


def loss_chunk_tokens(cfg: TrainConfig) -> int:
    """Tokens per chunk of the output layer and loss as the run computes them
    (--loss-chunk-tokens; auto: AUTO_LOSS_CHUNK when a rank holds more tokens than
    that); 0: the plain path, all the rank's logits at once."""
    n = cfg.model.loss_chunk_tokens
    if n is not None:
        return n
    tokens = cfg.optimizer.micro_batch_size * cfg.model.seq_length \
        // cfg.parallelism.context_parallel_size
    return AUTO_LOSS_CHUNK if tokens > AUTO_LOSS_CHUNK else 0


def bytes_per_param(cfg: TrainConfig, dp_cp: int) -> float:
    """Weights, gradients and AdamW per parameter on a rank (``dp_cp``: DP x CP)."""
    e = _element_bytes(cfg)
    if not cfg.optimizer.use_distributed_optimizer:
        return 20 if e == 2 else 16
    return 2 * e + 16 / dp_cp


def estimate(cfg: TrainConfig, world_size: int, vocab: int | None = None) -> Estimate:
    """The parameter counts, memory per rank and FLOPs per step of ``cfg`` on
    ``world_size`` ranks (``vocab``: before padding; default --vocab-size or 257)."""
    tp, cp = cfg.parallelism.tensor_model_parallel_size, cfg.parallelism.context_parallel_size
    h, e = cfg.model.hidden_size, _element_bytes(cfg)
    v = _vocab(cfg, vocab)
    pos = (cfg.model.max_position_embeddings or cfg.model.seq_length) * h \
        if cfg.model.position_embedding_type == "learned_absolute" else 0
    per_layer = _layer_params(cfg)
    per_rank = v * h // tp + pos + cfg.model.num_layers * _layer_params(cfg, tp) + 2 * h
    tokens = cfg.optimizer.micro_batch_size * cfg.model.seq_length // cp
    full = cfg.model.recompute_granularity == "full"
    saved = cfg.model.num_layers * (SAVED_ELEMENTS_FULL if full else SAVED_ELEMENTS) * e * h
    # the loss's logits and a layer's backward working set are never alive together
    logit_tokens = min(loss_chunk_tokens(cfg) or tokens, tokens)
    working = max(tokens * WORKING_SET_PER_WIDTH * h * e // 4,
                  logit_tokens * LOGIT_BYTES * v // tp)
    dp = max(world_size // (tp * cp), 1)
    gbs = cfg.optimizer.global_batch_size or cfg.optimizer.micro_batch_size * dp
    return Estimate(
        embedding=v * h,
        position_table=pos,
        per_layer=per_layer,
        layers=cfg.model.num_layers * per_layer,
        final_norm=2 * h,
        params_per_rank=per_rank,
        tokens_per_rank=tokens,
        state_bytes=int(per_rank * bytes_per_param(cfg, dp * cp)),
        activation_bytes=tokens * saved + working,
        flops_per_step=model_flops_per_token(cfg, vocab) * gbs * cfg.model.seq_length,
    )


# What --dry-run plans for without --device-memory or a visible GPU: an 80 GiB device,
# the memory of the usual training accelerators (A100 80GB, H100), said in the plan.
PLANNED_DEVICE_GIB = 80


def planned_device_memory(gib: float | None) -> tuple[int, str]:
    """(bytes, what they are) of the accelerator ``--dry-run`` plans for: ``--device-memory``,
    else the visible GPU's memory, else an assumed 80 GiB device. Never the host's RAM:
    a plan made on a login node is for the cluster's accelerators."""
    import torch

    if gib is not None:
        if not gib > 0:
            raise ConfigError(f"--device-memory: expected GiB > 0, got {gib:g}")
        return int(gib * GIB), f"--device-memory {gib:g} GiB"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return int(props.total_memory), f"{props.name}'s {props.total_memory / GIB:.0f} GiB"
    return PLANNED_DEVICE_GIB * GIB, (f"an assumed {PLANNED_DEVICE_GIB} GiB accelerator "
                                      f"(--device-memory sets it)")


def _g(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _tflop(flops: float) -> str:
    t = flops / 1e12
    return f"{t:,.0f}" if t >= 100 else f"{t:.3g}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n:,}"


def summary(cfg: TrainConfig, world_size: int, vocab: int | None = None,
            device: tuple[int, str] | None = None) -> list[str]:
    """The lines ``hla-sp train --dry-run`` prints, warnings last (prefixed "warning:")."""
    est = estimate(cfg, world_size, vocab)
    lines = [
        f"parameters: {_count(est.total)} = embedding {_count(est.embedding)} + position table "
        f"{_count(est.position_table)} + {cfg.model.num_layers} layers x {_count(est.per_layer)} + "
        f"final norm {_count(est.final_norm)}; {_count(est.params_per_rank)} per TP rank",
        f"memory per rank (docs/launch.md, the memory model): about "
        f"{_g(est.memory_bytes)} = {_g(FIXED_BYTES)} fixed + {_g(est.state_bytes)} weights, "
        f"gradients and AdamW + {_g(est.activation_bytes)} activations for "
        f"{est.tokens_per_rank:,} tokens per rank",
        f"model FLOPs: {_tflop(est.flops_per_step)} TFLOP per step "
        f"({model_flops_per_token(cfg, vocab) / 1e9:.3g} GFLOP per token, recompute not counted)",
    ]
    if est.position_table > est.layers:
        lines.append(
            f"warning: the position table ({_count(est.position_table)}) holds more parameters "
            f"than the {cfg.model.num_layers} layers ({_count(est.layers)}); "
            f"--position-embedding-type rope (CUDA) or none drops it"
        )
    if device is not None and est.memory_bytes > device[0]:
        lines.append(
            f"warning: about {_g(est.memory_bytes)} per rank exceeds {_g(device[0])} "
            f"({device[1]}); " + advice(cfg, world_size, device[0], vocab)
        )
    return lines


def advice(cfg: TrainConfig, world_size: int, capacity: int | None = None,
           vocab: int | None = None) -> str:
    """Which of recomputation, CP and micro-batch to change, and by how much, from the
    memory model: each change with the memory per rank it would give, those that fit
    ``capacity`` first (and full recompute with more CP when no single change fits)."""
    now = estimate(cfg, world_size, vocab).memory_bytes

    def mem(c: TrainConfig, k: int = 1) -> int:
        return estimate(c, world_size * k, vocab).memory_bytes

    def fits(m: int) -> bool:
        return capacity is None or m <= capacity

    def more_cp(c: TrainConfig) -> tuple[int, TrainConfig] | None:
        """The smallest CP multiple (x2 .. x16) that fits, else the largest that splits T."""
        best = None
        for k in (2, 4, 8, 16):
            if c.model.seq_length % (2 * c.parallelism.context_parallel_size * k):
                break
            best = (k, c.replace(context_parallel_size=c.parallelism.context_parallel_size * k))
            if fits(mem(best[1], k)):
                break
        return best

    options: list[tuple[int, str]] = []
    full = cfg.replace(recompute_granularity="full")
    if cfg.model.recompute_granularity != "full":
        options.append((mem(full), "--recompute-granularity full"))
    cp = more_cp(cfg)
    if cp is not None:
        options.append((mem(cp[1], cp[0]), f"--context-parallel-size "
                                           f"{cp[1].parallelism.context_parallel_size} "
                                           f"({cp[0]}x the ranks)"))
    dp_cp = world_size // cfg.parallelism.tensor_model_parallel_size
    if not cfg.optimizer.use_distributed_optimizer and dp_cp > 1:
        options.append((mem(cfg.replace(use_distributed_optimizer=True)),
                        f"--use-distributed-optimizer (AdamW's state over DP x CP = {dp_cp})"))
    if cfg.optimizer.micro_batch_size > 1:
        mbs = max(cfg.optimizer.micro_batch_size // 2, 1)
        options.append((mem(cfg.replace(micro_batch_size=mbs)),
                        f"--micro-batch-size {mbs} (the same global batch, more accumulation)"))
    if not any(fits(m) for m, _ in options) and cfg.model.recompute_granularity != "full":
        both = more_cp(full)
        if both is not None:
            options.append((mem(both[1], both[0]),
                            f"--recompute-granularity full with --context-parallel-size "
                            f"{both[1].parallelism.context_parallel_size} ({both[0]}x the ranks)"))
    if not options:
        return f"the memory model gives {_g(now)} per rank and has no smaller layout to offer"
    good = [o for o in options if fits(o[0])]
    shown = sorted(good) if good else sorted(options)[:1]
    return (f"the memory model gives {_g(now)} per rank; "
            + ("" if good or capacity is None else "the closest change, still too large: ")
            + "; or ".join(f"{flag} gives {_g(m)}" for m, flag in shown))

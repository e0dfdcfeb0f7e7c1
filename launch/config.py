"""The trainer's configuration: one dataclass, one docstring per field, which is the CLI help.

Flags use Megatron-LM's spellings (``--num-layers``, ``--seq-length``,
``--context-parallel-size``, ...). The HLA flags (``--attention``, ``--hla-*``) come
from :func:`hla_sp.megatron_patch.add_hla_args`, so the trainer and Megatron's own
``pretrain_gpt`` accept the same ones.

The checks (:func:`validate` and what it calls) live in :mod:`hla_sp.launch.checks`;
they are re-exported here, where callers have always imported them.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import os
import textwrap
import types
import typing
from dataclasses import dataclass, field
from typing import Any

# The flag error, defined with the other known errors (the checks import this module,
# and this module imports no check: launch's modules form no circle).
from hla_sp.launch.errors import ConfigError
from hla_sp.launch.flags import (
    OneLineParser,
    RaisingParser,
    expand_config,
    import_user_modules,
)

__all__ = [
    "ConfigError", "TrainConfig", "add_hla_flags", "build_parser", "field_docs", "flag_names",
    "parse_args", "world_size_from_env",
]


@dataclass
class TrainConfig:
    """Everything ``hla_sp.launch.train`` needs; each field is the flag ``--field-name``."""

    # --- model -------------------------------------------------------------------
    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Transformer hidden size."""
    num_attention_heads: int = 4
    """Number of attention (query) heads."""
    num_query_groups: int | None = None
    """Key/value head groups for GQA (default: one per head)."""
    ffn_hidden_size: int | None = None
    """MLP hidden size (default: 4 x hidden size)."""
    seq_length: int = 256
    """Tokens per sample. With context parallelism it must be divisible by
    2 x context-parallel-size (Megatron's zigzag split)."""
    max_position_embeddings: int | None = None
    """Size of the learned position table (default: seq-length)."""
    position_embedding_type: str = "learned_absolute"
    """learned_absolute, rope or none. rope needs CUDA (megatron-core's rotary embedding
    runs on the current CUDA device) and is refused on CPU; HLA with decay needs no
    positions, and none saves seq-length x hidden parameters at long context."""
    rotary_base: int = 10000
    """Base of the rotary embedding's frequencies (--position-embedding-type rope)."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that RoPE rotates."""
    vocab_size: int | None = None
    """Vocabulary size before padding: the tokenizer's, as in Megatron (default: 257, the
    byte-level tokens of the built-in data and of make_dataset). The data is not scanned
    for it; a token id outside it is refused when read, naming the file."""
    tokenizer: str | None = None
    """make-dataset's --tokenizer (bytes, a path or a hub name); gives --vocab-size's default."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times the tensor-parallel size."""
    hidden_dropout: float = 0.0
    """Dropout after attention and MLP. Megatron defaults to 0.1; 0 is the usual choice
    for pretraining and keeps runs comparable across CP sizes."""
    attention_dropout: float = 0.0
    """Dropout inside core attention (passed to the core attention)."""
    init_method_std: float = 0.02
    """Standard deviation of the weight initialisation."""

    # --- batching and optimisation -----------------------------------------------
    micro_batch_size: int = 1
    """Samples per microbatch on each data-parallel rank."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all data-parallel ranks (default: micro-batch
    size x data-parallel size); the rest is gradient accumulation."""
    train_iters: int = 20
    """Optimizer steps to train for."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the decay."""
    lr_warmup_iters: int = 0
    """Linear warmup steps from 0 to --lr."""
    lr_decay_iters: int | None = None
    """Steps over which the learning rate decays to --min-lr (default: --train-iters)."""
    lr_decay_style: str = "cosine"
    """cosine, linear or constant."""
    weight_decay: float = 0.01
    """AdamW weight decay (not applied to biases and norms)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    check_for_nan_in_loss_and_grad: bool = True
    """Stop the run when the loss or the gradient norm is NaN or infinite, before the
    optimizer steps and with nothing saved, naming the iteration, the value and the last
    finite checkpoint (Megatron's flag; --no-check-for-nan-in-loss-and-grad trains on).
    An fp16 overflow stays a skipped step."""
    seed: int = 1234
    """Seed for initialisation, dropout and data order."""

    # --- precision (Megatron's mixed precision: fp32 master weights and grads) -----
    bf16: bool = False
    """Run the model in bfloat16; the optimizer keeps fp32 master weights and
    gradients are accumulated, reduced and clipped in fp32 (Megatron's --bf16)."""
    fp16: bool = False
    """Run the model in float16 with fp32 master weights and a loss scale (dynamic
    unless --loss-scale is set); steps whose gradients overflow are skipped."""
    loss_scale: float | None = None
    """With --fp16: a static loss scale (default: dynamic)."""
    initial_loss_scale: float = 2.0**32
    """With --fp16: the dynamic loss scale's initial value."""
    min_loss_scale: float = 1.0
    """With --fp16: the dynamic loss scale never goes below this."""
    loss_scale_window: int = 1000
    """With --fp16: steps without overflow before the dynamic scale doubles."""
    hysteresis: int = 2
    """With --fp16: overflowing steps tolerated before the dynamic scale halves."""

    # --- parallelism -------------------------------------------------------------
    context_parallel_size: int = 1
    """Ranks that share one sequence (HLA's exact scan runs across them)."""
    tensor_model_parallel_size: int = 1
    """Ranks that share each weight matrix (Megatron tensor parallelism)."""
    distributed_timeout_minutes: float = 10.0
    """Process-group timeout: a hung or dead peer ends every rank after this long."""

    # --- memory ------------------------------------------------------------------
    recompute_activations: bool = False
    """Recompute core attention in backward (Megatron's selective recompute)."""
    recompute_granularity: str | None = None
    """full (recompute every transformer layer; the least memory) or selective."""

    # --- data --------------------------------------------------------------------
    data: str = "text"
    """text (Megatron data from --data-path, else the Python standard library's sources
    as bytes) or synthetic-recall (key-value pairs early, queried in the second half;
    the loss can only fall below ln(64) if information crosses context-parallel ranks)."""
    data_path: list[str] | None = None
    """Prefixes of Megatron indexed datasets (PREFIX.bin and PREFIX.idx), concatenated;
    or weight-prefix pairs as Megatron takes them (0.5 A 0.5 B), blended by weight."""
    recall_pairs: int = 8
    """Key-value pairs per sample for --data synthetic-recall."""
    recall_filler: str = "random"
    """The tokens around the pairs and queries of --data synthetic-recall: random (a
    fresh id per position, so the state must also learn to ignore noise) or constant
    (one id everywhere, the filler of Zoology's MQAR)."""
    split: str = "969,30,1"
    """Train, validation and test weights of the data (Megatron's --split): the first
    share of the samples trains, the next is the held-out validation set."""

    # --- evaluation --------------------------------------------------------------
    eval_interval: int | None = None
    """Compute the validation loss every this many iterations and at the end (default:
    never)."""
    eval_iters: int = 10
    """Global batches of the validation split per evaluation (the same ones each time)."""
    skip_train: bool = False
    """Train nothing: evaluate the checkpoint in --load (or --ckpt-step) once on the
    held-out split that --seed and the data flags give, print the result, log it to
    --log-jsonl as an "evaluation" event, and exit (Megatron's --skip-train). The
    checkpoint may come from another TP, CP or DP size."""

    # --- checkpoints -------------------------------------------------------------
    save: str | None = None
    """Directory to write checkpoints to (atomically)."""
    load: str | None = None
    """Directory to resume from (its latest complete checkpoint)."""
    ckpt_step: int | None = None
    """With --load: resume from this iteration's checkpoint instead of the latest."""
    keep_last: int | None = None
    """Keep only the newest this many checkpoints in --save; older ones are deleted once
    a newer one is complete (default: keep every checkpoint). The newest finite
    checkpoint and the one this run resumed from are never deleted."""
    break_save_lock: bool = False
    """Take --save's lock (save.lock) even though another run holds it: for a lock left
    by a run on another host that no longer runs (one on this host whose process is gone
    is taken over anyway)."""
    override_opt_param_scheduler: bool = False
    """On resume, apply this run's learning-rate schedule flags instead of the
    checkpoint's (Megatron's --override-opt_param-scheduler)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, keep the checkpoint's learning-rate schedule, whatever this run's flags
    say (Megatron's --use-checkpoint-opt_param-scheduler). Without either flag a changed
    --lr, --min-lr, --lr-warmup-iters, --lr-decay-style, --weight-decay or decay length
    (--lr-decay-iters, default --train-iters) is refused with the difference."""
    save_interval: int | None = None
    """Save every this many iterations (and always at the end when --save is set)."""
    exit_interval: int | None = None
    """Stop (saving first when --save is set) once the iteration is a multiple of this."""
    exit_signal_handler: bool = False
    """On SIGINT or SIGTERM, finish the current iteration, save (with --save), draw the
    plot and print the command that resumes (Megatron's --exit-signal-handler). Without
    it a signal stops the run at once, with one line and no checkpoint."""

    # --- logging -----------------------------------------------------------------
    log_interval: int = 1
    """Print a progress line every this many iterations (rank 0)."""
    log_jsonl: str | None = None
    """Append one JSON object per iteration to this file (rank 0); a line with "event":
    "start" marks where each run (or resumed run) begins. At the end of the run a plot of
    loss and throughput goes next to it (same name, .png; needs matplotlib), redrawn
    every --log-interval iterations while the run goes."""
    tensorboard_dir: str | None = None
    """Write loss, learning rate, gradient norm, throughput and memory as TensorBoard
    scalars to this directory (rank 0; needs pip install "hla-sp[tensorboard]")."""
    wandb_project: str | None = None
    """Log the same scalars and the config to this Weights & Biases project (rank 0;
    needs the wandb package)."""
    wandb_exp_name: str | None = None
    """With --wandb-project: the run's name (default: wandb's)."""
    peak_tflops: float | None = None
    """The device's peak TFLOP/s, for the model FLOPs utilisation (MFU) of the progress
    line and the logs. Default: the dense peak of a known GPU at the run's precision
    (H100/H200: 989 with --bf16/--fp16, 495 tf32; A100: 312, 156); none on a CPU or an
    unknown device, which then logs no MFU."""

    # --- attention (filled from hla_sp.megatron_patch.add_hla_args) --------------
    hla: dict[str, Any] = field(default_factory=dict)
    """The --attention and --hla-* flags, as parsed by add_hla_args."""

    # ------------------------------------------------------------------------------
    @property
    def attention(self) -> str:
        """The core attention: softmax, hla2, ahla or hla3."""
        return str(self.hla.get("attention", "softmax"))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly copy (what checkpoints and Ray workers carry)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown config keys {sorted(unknown)}; known: {sorted(names)}")
        return cls(**d)


# The filler layouts of --data synthetic-recall (launch/data.py's RecallSamples).
RECALL_FILLERS = ("random", "constant")

_CHOICES = {
    "position_embedding_type": ["learned_absolute", "rope", "none"],
    "lr_decay_style": ["cosine", "linear", "constant"],
    "recompute_granularity": ["full", "selective"],
    "data": ["text", "synthetic-recall"],
    "recall_filler": list(RECALL_FILLERS),
}


# Megatron spells a few flags half with underscores; both spellings are accepted.
_MEGATRON_SPELLINGS = {
    "override_opt_param_scheduler": ("--override-opt_param-scheduler",),
    "use_checkpoint_opt_param_scheduler": ("--use-checkpoint-opt_param-scheduler",),
}


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under each dataclass field (the torchtitan convention)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _base_type(tp: Any) -> tuple[type, bool]:
    """(element type, is_list) of an annotation like ``int | None`` or ``list[str] | None``."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        tp = args[0]
    if typing.get_origin(tp) is list:
        return typing.get_args(tp)[0], True
    return tp, False


def add_hla_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--attention`` and the ``--hla-*`` flags from the Megatron drop-in."""
    from hla_sp.megatron_patch import add_hla_args

    add_hla_args(parser)
    from hla_sp.megatron_patch.hybrid import add_hybrid_args

    add_hybrid_args(parser)  # --hla-layer-pattern: HLA in some layers, softmax in the rest
    # The trainer exists to train HLA; Megatron's own entry point keeps softmax as default.
    parser.set_defaults(attention="hla2")


def build_parser(
    prog: str = "hla_sp.launch.train", raise_errors: bool = False
) -> argparse.ArgumentParser:
    """The trainer's argument parser, generated from :class:`TrainConfig`."""
    parser = (RaisingParser if raise_errors else OneLineParser)(
        prog=prog,
        description="Train a megatron-core GPT with HLA attention and context parallelism.",
        allow_abbrev=False,  # as Megatron's parser: no prefix surprises between flags
    )
    parser.add_argument(
        "--config", metavar="TOML", default=None, action="append",
        help="Read trainer flags from this TOML file (keys are the flag names, with - or _: "
             "seq_length = 4096; tables only group them, so a key is given once). Several "
             "--config files merge in order, the later winning; flags on the command line "
             "win over all of them.",
    )
    docs = field_docs(TrainConfig)
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name == "hla":
            continue
        flag = "--" + f.name.replace("_", "-")
        tp, is_list = _base_type(hints[f.name])
        help_text = docs.get(f.name, "")
        if tp is bool:
            # a flag on by default also takes --no-FLAG (--no-check-for-nan-in-loss-and-grad)
            parser.add_argument(flag, *_MEGATRON_SPELLINGS.get(f.name, ()),
                                action=argparse.BooleanOptionalAction if f.default is True
                                else "store_true", default=f.default, help=help_text)
            continue
        default = f.default
        kw: dict[str, Any] = {"type": tp, "default": default, "help": help_text}
        if is_list:
            kw["nargs"] = "+"
        if f.name in _CHOICES:
            kw["choices"] = _CHOICES[f.name]
        if default is not None and not is_list:
            kw["help"] = f"{help_text} (default: {default})"
        parser.add_argument(flag, **kw)
    add_hla_flags(parser)
    return parser


def parse_args(
    argv: list[str] | None = None, raise_errors: bool = False, prog: str = "hla_sp.launch.train"
) -> TrainConfig:
    """Parse trainer flags (and a ``--config`` TOML file) into a :class:`TrainConfig` (the
    HLA flags land in ``cfg.hla``); with ``raise_errors`` a bad flag raises
    :class:`ConfigError` instead of exiting with one line."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # The user's modules first (in the launcher and in every worker): the operators
        # they register are --attention's choices, so they must exist before any parser.
        import_user_modules(argv)
        argv = expand_config(argv, lambda: build_parser(prog, raise_errors=True))
        import_user_modules(argv)  # and those a --config file names
    except ConfigError as e:
        if raise_errors:
            raise
        sys.exit(f"{prog}: error: {e}")
    ns = vars(build_parser(prog, raise_errors=raise_errors).parse_args(argv))
    ns.pop("config", None)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    hla = {k: v for k, v in ns.items() if k not in names}
    return TrainConfig(**{k: v for k, v in ns.items() if k in names}, hla=hla)


def flag_names() -> dict[str, str]:
    """Every trainer flag's destination name (``hidden_size``, ``hla_decay``) -> flag."""
    out = {}
    for action in build_parser()._actions:
        if action.dest != "help" and action.option_strings:
            out[action.dest] = action.option_strings[0]
    return out


def world_size_from_env() -> int:
    """The world size torchrun (or Ray, or SLURM via torchrun) announces, 1 if none."""
    return int(os.environ.get("WORLD_SIZE", "1"))

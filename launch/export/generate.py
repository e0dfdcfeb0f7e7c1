"""``hla-sp generate``: prefill a prompt, then decode token by token with each layer's state.

    hla-sp generate --load DIR --prompt TEXT [--max-new-tokens N] [--temperature T]
                    [--top-k K] [--seed S] [--device cpu] [--ckpt-step N]

The model is rebuilt from the checkpoint's ``config.json`` (one process, no context or
tensor parallelism) and its weights are read from the checkpoint's pieces of whole
tensors, so a checkpoint of any TP, CP or DP size loads (one of the first format, with
one ``model_optim_tpNN.pt`` per TP rank, only when TP was 1). Text goes through the run's
``--tokenizer`` (bytes by default); a line on stderr first names the iteration and loss.

Every HLA layer keeps its recurrent state (:class:`RecurrentState` in its core
attention) across the model's forwards: the prompt is one forward (the chunk-parallel
prefill) and each new token one forward of length 1, whose cost does not depend on how
long the context already is; softmax attention instead reads a KV cache that grows by
one entry per token (benchmarks/bench_generate.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from hla_sp.launch import checkpoint
from hla_sp.launch.checkpoint.run_config import saved_losses
from hla_sp.launch.config.flags import OneLineParser
from hla_sp.launch.config.train_config import ConfigError, TrainConfig
from hla_sp.launch.data.tokenizer import RunTokenizer, load_run_tokenizer, load_tokenizer
from hla_sp.launch.distributed.process_groups import parallel_state
from hla_sp.launch.model.build import build_model, model_dtype, softmax_layers
from hla_sp.launch.progress import Progress

BYTE_VOCAB = 257  # ids 0..255 are bytes, EOD ends a document (hla_sp.launch.data.datasets)
EOD = 256
# the smallest non-zero --temperature. Logits divided by a temperature near float64's
# smallest (1e-310) overflow to inf, and the softmax of inf - inf is nan; long before
# that, at 1e-6, the gap between the two likeliest tokens is 1e6 times wider than any
# softmax resolves, so sampling is the argmax already (0 asks for that by name)
MIN_TEMPERATURE = 1e-6
# generations longer than this show progress with an ETA (launch/progress.py)
PROGRESS_TOKENS = 256


class GenerateError(RuntimeError):
    """A checkpoint or request generate cannot serve; the message is one line."""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="hla-sp generate", allow_abbrev=False,
        description="Sample from a checkpoint of hla-sp train: prefill the prompt, then "
                    "decode one token at a time with each HLA layer's recurrent state.")
    p.add_argument("--load", required=True, help="Checkpoint directory (hla-sp train --save).")
    p.add_argument("--ckpt-step", type=int, default=None,
                   help="Load this iteration instead of the latest.")
    p.add_argument("--custom-import", action="append", default=[], metavar="MODULE",
                   help="Import this module first (one that registers an operator); the "
                        "modules the training run named are imported anyway.")
    p.add_argument("--prompt", default="", help="Text to continue; empty: start a document.")
    p.add_argument("--max-new-tokens", type=int, default=200, help="Tokens to sample.")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy (argmax).")
    p.add_argument("--top-k", type=int, default=0, help="Sample among the k likeliest (0: all).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the sampling.")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N.")
    p.add_argument("--stop-at-eod", action=argparse.BooleanOptionalAction, default=True,
                   help="Stop at the tokenizer's end of document (else: a new line).")
    return p


def check_request(args: argparse.Namespace) -> None:
    """The sampling flags, named in the error."""
    if args.max_new_tokens < 0:
        raise GenerateError(f"--max-new-tokens: expected >= 0, got {args.max_new_tokens}")
    t = args.temperature
    if not (t == 0 or MIN_TEMPERATURE <= t < float("inf")):  # also refuses nan
        raise GenerateError(f"--temperature: expected >= 0 (0: greedy; otherwise finite and "
                            f"at least {MIN_TEMPERATURE:g}), got {t!r}")
    if args.top_k < 0:
        raise GenerateError(f"--top-k: expected >= 0 (0: no cut), got {args.top_k}")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # bytes the shell passed that are not UTF-8
        raise GenerateError(
            f"--prompt: expected UTF-8 text, got bytes that are not UTF-8 at character "
            f"{e.start} ({args.prompt[e.start:e.end].encode('utf-8', 'surrogateescape')!r})"
        ) from None
    check_device(args.device)


def check_device(device: str) -> None:
    """``--device`` names a device this machine has: cpu, cuda or cuda:N."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise GenerateError(f"--device: expected cpu, cuda or cuda:N, got {device!r}") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise GenerateError(f"--device: expected cpu, cuda or cuda:N, got {device!r}")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise GenerateError(f"--device {device}: expected a CUDA device, but this machine has "
                            f"none (torch.cuda.is_available() is False); use --device cpu")
    if dev.index is not None and dev.index >= n:
        raise GenerateError(f"--device {device}: expected cuda:0 .. cuda:{n - 1} (this machine "
                            f"has {n} CUDA device{'s' if n > 1 else ''}), got index {dev.index}")


def load_config(load: str, step: int | None = None, decodable: bool = True
                ) -> tuple[TrainConfig, int]:
    """The config of a checkpoint under ``load`` (its latest iteration, or ``step``), with
    ``decodable`` checked to be one generate decodes; (config, iteration)."""

    try:
        cfg, it = checkpoint.load_run_config(load, step)
    except (ConfigError, checkpoint.CheckpointError) as e:
        raise GenerateError(str(e)) from None
    if decodable:
        check_decodable(cfg)
    return cfg, it


def check_decodable(cfg: TrainConfig) -> None:
    """Refuse, in one line, the models whose decode this command does not implement."""
    softmax = softmax_layers(cfg)
    if softmax is not None:
        raise GenerateError(f"checkpoint: expected HLA attention in every layer (its state is "
                            f"what generate decodes with), got {softmax}")
    if cfg.model.position_embedding_type == "rope":
        raise GenerateError("checkpoint: position_embedding_type 'rope' is not decoded (a "
                            "one-token forward would rotate at position 0); expected "
                            "learned_absolute or none")


def decode_config(cfg: TrainConfig) -> TrainConfig:
    """The training config as one process decodes it: no CP, TP or recompute (the
    checkpoint's pieces reshard into one process's whole tensors)."""
    return cfg.replace(context_parallel_size=1, tensor_model_parallel_size=1,
                               recompute_granularity=None, recompute_activations=False)


def _quiet_megatron() -> None:
    """Megatron warns about apex/TE as it imports; on CPU that is the expected state (as
    in hla_sp.launch.train). Call inside ``warnings.catch_warnings()``."""
    warnings.filterwarnings("ignore", message=".*(Apex|apex|full scope is deprecated).*")


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """A process group of one and Megatron's model-parallel groups (TP = CP = 1) for the
    model's construction; torn down after, when this call made them."""
    ps = parallel_state()

    made_group = not dist.is_initialized()
    if made_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    made_ps = not ps.model_parallel_is_initialized()
    if made_ps:
        ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1,
                                     create_gloo_process_groups=False)
    try:
        yield
    finally:
        if made_ps:
            ps.destroy_model_parallel()
        if made_group:
            dist.destroy_process_group()


def load_model(load: str, step: int | None = None, device: str = "cpu",
               decodable: bool = True) -> tuple[torch.nn.Module, TrainConfig]:
    """The checkpoint's GPTModel in eval mode on ``device``, and its config (``decodable``:
    refuse what generate cannot decode; export reads every checkpoint). Call inside
    :func:`single_process`."""

    cfg, it = load_config(load, step, decodable)
    cfg = decode_config(cfg)
    dev = torch.device(device)
    torch.manual_seed(cfg.optimizer.seed)  # the weights are overwritten; this keeps the build quiet
    model = build_model(cfg, cfg.model.vocab_size or BYTE_VOCAB, dev).to(dev, model_dtype(cfg))
    try:
        checkpoint.load_weights(load, it, model)
    except checkpoint.CheckpointError as e:
        raise GenerateError(str(e)) from None
    return model.eval(), cfg


def max_positions(model: torch.nn.Module) -> int | None:
    """How many positions the model can embed (its learned table), None without one."""
    table = getattr(getattr(model, "embedding", None), "position_embeddings", None)
    return None if table is None else int(table.num_embeddings)


def check_positions(model: torch.nn.Module, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse a request longer than the model's learned positions, before any work."""
    limit = max_positions(model)
    # the last sampled token is never fed back, so it needs no position
    need = prompt_tokens + max(max_new_tokens - 1, 0)
    if limit is not None and prompt_tokens > limit:
        # the prompt alone does not fit: no number of new tokens helps
        raise GenerateError(
            f"--prompt: expected at most {limit} tokens (the model's learned "
            f"positions, its --seq-length), got {prompt_tokens}; shorten it by "
            f"{prompt_tokens - limit}")
    if limit is not None and need > limit:
        raise GenerateError(
            f"--max-new-tokens: the prompt ({prompt_tokens} tokens) and {max_new_tokens} "
            f"new tokens need {need} positions, the model has {limit} (its --seq-length); "
            f"ask for at most {max(limit - prompt_tokens + 1, 0)}")


class Decoder:
    """Decodes one sequence through a GPTModel with each HLA layer's state.

    Use as a context manager: inside it every core attention of ``model`` holds a
    :class:`RecurrentState`, and :meth:`advance` feeds the next tokens. A first call
    over the prompt is the prefill; calls of one token are the decode steps.
    """

    def __init__(self, model: torch.nn.Module):
        from hla_sp.megatron_patch.core_attention import HLACoreAttention

        self.model = model
        self.cores = [m for m in model.modules() if isinstance(m, HLACoreAttention)]
        if not self.cores:
            raise GenerateError("model: expected HLA core attention, found none")
        self.limit = max_positions(model)
        self.position = 0
        self.device = next(model.parameters()).device

    def __enter__(self) -> Decoder:
        from hla_sp.megatron_patch.core_attention import RecurrentState

        for core in self.cores:
            core.recurrent = RecurrentState()
        self.position = 0
        return self

    def __exit__(self, *exc: object) -> None:
        for core in self.cores:
            core.recurrent = None

    @torch.no_grad()
    def advance(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed tokens [1, n] after those fed so far; returns their logits [1, n, vocab]."""
        if tokens.dim() != 2 or tokens.shape[0] != 1 or tokens.shape[1] < 1:
            raise ValueError(f"tokens: expected [1, n] with n >= 1, got {tuple(tokens.shape)}")
        n = tokens.shape[1]
        if self.limit is not None and self.position + n > self.limit:
            raise GenerateError(f"the context reached the model's {self.limit} learned "
                                f"positions (its --seq-length); ask for fewer tokens")
        pos = torch.arange(self.position, self.position + n, device=self.device)[None]
        logits = self.model(tokens.to(self.device), pos, None)
        self.position += n
        return logits


def sample(logits: torch.Tensor, temperature: float, top_k: int,
           generator: torch.Generator | None, vocab: int = BYTE_VOCAB) -> int:
    """One token from logits [padded vocab], drawn among the first ``vocab`` ids only."""
    x = logits[:vocab].double()
    if temperature == 0:
        return int(x.argmax())
    x = x / temperature
    if 0 < top_k < x.numel():
        cut = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < cut, float("-inf"))
    probs = torch.softmax(x, -1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


@dataclasses.dataclass
class Generation:
    """What :func:`generate` produced: the new token ids and the two phases' timings."""

    tokens: list[int]
    prompt_tokens: int
    prefill_s: float
    decode_s: float


def prompt_ids(prompt: str, tok: RunTokenizer | None = None) -> list[int]:
    """The prompt's ids by ``tok`` (None: bytes); an empty prompt starts a document (EOD)."""
    tok = tok or load_tokenizer(None)
    return tok.encode(prompt) or [tok.eod]


def generate(model: torch.nn.Module, prompt: list[int], max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, seed: int = 0, stop_at_eod: bool = True,
             on_token: Callable[[int], None] | None = None, eod: int = EOD,
             vocab: int = BYTE_VOCAB) -> Generation:
    """Prefill ``prompt`` (ids), then sample up to ``max_new_tokens`` ids < ``vocab``."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    check_positions(model, len(prompt), max_new_tokens)
    with Decoder(model) as dec:
        t0 = time.perf_counter()
        logits = dec.advance(torch.tensor([prompt]))[0, -1]
        t1 = time.perf_counter()
        for i in range(max_new_tokens):
            tok = sample(logits, temperature, top_k, gen, vocab)
            if stop_at_eod and tok == eod:
                break
            out.append(tok)
            if on_token is not None:
                on_token(tok)
            if i + 1 < max_new_tokens:
                logits = dec.advance(torch.tensor([[tok]]))[0, -1]
        t2 = time.perf_counter()
    return Generation(out, len(prompt), t1 - t0, t2 - t1)


def header(load: str, it: int) -> str:
    """The line before the text: the checkpoint, its iteration, the loss it recorded."""
    losses = saved_losses(load, it)
    said = next((f"{what} loss {losses[k]:.4g} nats per token" for k, what in
                 (("val_loss", "validation"), ("loss", "train")) if k in losses),
                "no loss recorded in the checkpoint")
    return f"hla-sp generate: {load} iteration {it} ({said})"


def _stream(args: argparse.Namespace) -> Generation:
    """Load model and tokenizer, name the checkpoint, print the prompt, then each token."""
    cfg, it = load_config(args.load, args.ckpt_step)
    tok = load_run_tokenizer(cfg)
    ids = prompt_ids(args.prompt, tok)
    model, _ = load_model(args.load, it, args.device)
    check_positions(model, len(ids), args.max_new_tokens)  # before printing anything
    print(header(args.load, it), file=sys.stderr, flush=True)
    text = tok.stream()
    sys.stdout.write(args.prompt)
    # a long generation shows its progress on stderr, unless the text itself streams to
    # a terminal (a bar there would break its lines)
    bar = Progress("generate", args.max_new_tokens, "tokens",
                   enabled=args.max_new_tokens > PROGRESS_TOKENS and not sys.stdout.isatty())

    def emit(t: int) -> None:
        sys.stdout.write(text.add(t))  # an end of document (--no-stop-at-eod): a new line
        sys.stdout.flush()
        bar.advance()

    with bar:
        g = generate(model, ids, args.max_new_tokens, args.temperature, args.top_k,
                     args.seed, args.stop_at_eod, emit, eod=tok.eod,
                     vocab=cfg.model.vocab_size or BYTE_VOCAB)
    sys.stdout.write(text.flush() + "\n")
    return g


def main(argv: list[str] | None = None) -> int:
    """The ``hla-sp generate`` command; the text goes to stdout, a timing line to stderr."""
    args = build_parser().parse_args(argv)
    try:
        from hla_sp.launch.extras import require

        require("megatron", "hla-sp generate")
        from hla_sp.megatron_patch.args import import_custom

        try:
            import_custom(args.custom_import)
        except ValueError as e:
            raise GenerateError(str(e)) from None
        check_request(args)
        with warnings.catch_warnings():
            _quiet_megatron()
            with single_process():
                g = _stream(args)
    except (GenerateError, ConfigError) as e:  # one line, not a traceback
        print(f"hla-sp generate: error: {e}", file=sys.stderr)
        return 2
    rate = len(g.tokens) / g.decode_s if g.decode_s > 0 else float("nan")
    print(f"hla-sp generate: prefill {g.prompt_tokens} tokens in {g.prefill_s:.2f} s; "
          f"decoded {len(g.tokens)} tokens at {rate:.1f} tokens/s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

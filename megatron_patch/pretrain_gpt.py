"""Megatron-LM's GPT pre-training loop with HLA attention.

    python -m hla_sp.megatron_patch.pretrain_gpt <Megatron-LM flags> --attention hla2

Runs ``megatron.training.pretrain`` with the HLA layer spec (TE variant when
transformer_engine imports and ``--transformer-impl transformer_engine``, else local).
``--attention softmax`` (the default) trains Megatron's own GPT layer.

``megatron.training`` ships with megatron-core >= 0.17 (Python >= 3.12) or comes from a
Megatron-LM checkout on PYTHONPATH; without it this module says so and exits with
status 3. The three ``pretrain`` APIs (<= 0.17, 0.18, 0.19+) are told apart by what the
installed version offers (:func:`hla_sp.megatron_patch.compat.pretrain_api`).

``--hla-layer-pattern`` makes a hybrid stack (:mod:`hla_sp.megatron_patch.hybrid`).
How the flags route to a layer spec, and the refusals that need them, are in
:mod:`hla_sp.megatron_patch.routing`; this module holds the providers and the entry point.

Silent failures guarded (status 2, before anything is built): ``--attention-backend
local`` with HLA, ``--spec`` with HLA, a ``--spec`` module that does not import, and
the flags of :mod:`hla_sp.megatron_patch.guards` (MTP, legacy models, MLA, ...). After
the model is built, :func:`assert_hla_model` (or, for a hybrid stack,
:func:`assert_hybrid_model`) checks every layer runs the attention asked for.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

from hla_sp.megatron_patch import compat
from hla_sp.megatron_patch.args import check_hla_args, custom_imports, hla_enabled, import_custom
from hla_sp.megatron_patch.compat import cp_split, pretrain_api, tokenizer, tp_broadcast_batch
from hla_sp.megatron_patch.hybrid import assert_hybrid_model, layer_pattern

# Re-exported: the route and refusal helpers lived here before routing.py.
from hla_sp.megatron_patch.routing import (
    check_args,
    expects_hla,
    extra_args,
    hla_route,
    layer_spec_from_args,
    prescan,
    resolve_spec,
)

__all__ = [
    "ARGS_DEFAULTS", "EXIT_BAD_FLAGS", "EXIT_NO_MEGATRON_TRAINING", "MegatronProviders",
    "check_args", "extra_args", "hla_route", "layer_spec_from_args", "main",
    "missing_training_message", "prescan", "resolve_spec", "run",
]

EXIT_BAD_FLAGS = 2
EXIT_NO_MEGATRON_TRAINING = 3
ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


def missing_training_message(err: BaseException) -> str:
    """What to say when ``megatron.training`` does not import."""
    try:
        import megatron.core as mc

        have = f"megatron-core {getattr(mc, '__version__', '?')} at {mc.__path__[0]}"
    except ImportError:
        have = "no megatron-core"
    return (
        f"hla_sp.megatron_patch.pretrain_gpt: megatron.training is not importable "
        f"({type(err).__name__}: {err}). It ships with megatron-core >= 0.17, which needs "
        f"Python >= 3.12 (this is Python {sys.version_info.major}.{sys.version_info.minor}, "
        f"with {have}), or comes from a Megatron-LM checkout on PYTHONPATH. Nothing was run."
    )


def _filter_kwargs(fn: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


class MegatronProviders:
    """The providers handed to ``megatron.training.pretrain`` (model, datasets, the
    forward step): Megatron-LM's loop trains; this only builds what it asks for."""

    def __init__(self, ns: argparse.Namespace, user_spec: Any = None):
        self.ns = ns
        self.user_spec = user_spec
        self.expect_hla = hla_enabled(ns) or (user_spec is not None and expects_hla(user_spec))
        self.operator = ns.attention if hla_enabled(ns) else None
        self.route = hla_route(ns, user_spec)
        self._checked = False
        self._eod: int | None = None
        self._vocab_masked: set[int] = set()

    # -- model -------------------------------------------------------------------------
    def check_model(self, model: Any) -> None:
        """Fail loudly when HLA was asked for and the model does not run it."""
        freq = getattr(self.ns, "hla_layer_pattern", None)
        if self.expect_hla and not self._checked and freq is not None:
            from megatron.training import get_args

            pattern = layer_pattern(freq, get_args().num_layers)
            found = assert_hybrid_model(model, pattern, self.operator)
            print(f"> hybrid stack, HLA where the pattern says 1: {pattern}; layers: "
                  f"{[found[i] for i in sorted(found)]}", flush=True)
        elif self.expect_hla and not self._checked:
            from hla_sp.megatron_patch.checks import assert_hla_model

            found = assert_hla_model(model, self.operator)
            print(f"> HLA attention in {len(found)} layer(s): {sorted(set(found.values()))}",
                  flush=True)
        self._checked = True

    def model_provider(self, pre_process: bool = True, post_process: bool = True,
                       vp_stage: int | None = None, config: Any = None,
                       pg_collection: Any = None, **_: Any) -> Any:
        """GPTModel with the flags' layer spec (API of megatron-core <= 0.18)."""
        from megatron.core.models.gpt import GPTModel
        from megatron.training import get_args
        from megatron.training.arguments import core_transformer_config_from_args

        args = get_args()
        check_hla_args(args)
        check_args(args, self.route)
        if config is None:
            config = core_transformer_config_from_args(args)
        kwargs = dict(
            config=config, transformer_layer_spec=layer_spec_from_args(args, self.user_spec),
            vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
            pre_process=pre_process, post_process=post_process,
            fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
            rope_scaling=getattr(args, "use_rope_scaling", False), vp_stage=vp_stage,
            pg_collection=pg_collection,
        )
        model = GPTModel(**_filter_kwargs(GPTModel.__init__, kwargs))
        self._checked = False
        self.check_model(model)
        return model

    def mask_vocab(self, model: Any) -> None:
        """Logits at Megatron's padding ids (>= the tokenizer's vocabulary) set to -inf in
        each model chunk, once (:mod:`hla_sp.megatron_patch.vocab`): the loss is then the
        same whatever ``--make-vocab-size-divisible-by`` x TP pads to."""
        if id(model) in self._vocab_masked:
            return
        from hla_sp.megatron_patch.vocab import mask_padded_vocab
        from megatron.training import get_args

        mask_padded_vocab(model, int(tokenizer(get_args()).vocab_size))
        self._vocab_masked.add(id(model))

    # -- data --------------------------------------------------------------------------
    def datasets_provider(self, train_val_test_num_samples: Any, vp_stage: Any = None) -> Any:
        """Megatron's GPT (or mock) datasets, configured from the parsed flags."""
        from megatron.core import parallel_state as ps
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder,
        )
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
        from megatron.training import get_args
        from megatron.training.utils import get_blend_and_blend_per_split

        args = get_args()
        blend, blend_per_split = get_blend_and_blend_per_split(args)
        candidates = dict(
            random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
            blend_per_split=blend_per_split, split=args.split,
            path_to_cache=getattr(args, "data_cache_path", None), tokenizer=tokenizer(args),
            reset_position_ids=args.reset_position_ids,
            reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
            create_attention_mask=getattr(args, "create_attention_mask_in_dataloader", False),
            mmap_bin_files=getattr(args, "mmap_bin_files", True),
            num_dataset_builder_threads=getattr(args, "num_dataset_builder_threads", 1),
            context_parallel_size=args.context_parallel_size,
            data_parallel_size=getattr(args, "data_parallel_size", None),
        )
        names = {f.name for f in dataclasses.fields(GPTDatasetConfig)}
        config = GPTDatasetConfig(**{k: v for k, v in candidates.items()
                                     if k in names and v is not None})
        dataset_type = MockGPTDataset if args.mock_data else GPTDataset

        def built_on_this_rank() -> bool:
            return ps.get_tensor_model_parallel_rank() == 0 and (
                ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage())

        return BlendedMegatronDatasetBuilder(
            dataset_type, train_val_test_num_samples, built_on_this_rank, config
        ).build()

    def documents(self, tokens: Any, args: Any) -> Any:
        """The HLA layers' documents of a whole micro-batch under ``--reset-attention-mask``
        (:mod:`hla_sp.megatron_patch.documents`), else None: HLA does not read Megatron's
        attention mask, so the documents are cut where it would cut them, at the EODs."""
        if not (self.expect_hla and getattr(args, "reset_attention_mask", False)):
            return None
        from hla_sp.megatron_patch.documents import DocumentParams

        if self._eod is None:
            self._eod = int(tokenizer(args).eod)
        return DocumentParams.from_tokens(tokens, self._eod)

    def get_batch(self, data_iterator: Any) -> tuple:
        """(tokens, labels, loss_mask, attention_mask, position_ids, documents) on this CP
        rank; documents: :meth:`documents` of the whole rows, before the CP split."""
        import torch
        from megatron.core import parallel_state as ps
        from megatron.training import get_args

        args = get_args()
        if not (ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()):
            return None, None, None, None, None, None
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        if ps.get_tensor_model_parallel_world_size() > 1:
            raw = next(data_iterator) if ps.get_tensor_model_parallel_rank() == 0 else None
            batch = tp_broadcast_batch(
                raw, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                with_attention_mask=bool(getattr(args, "create_attention_mask_in_dataloader",
                                                 False)),
                group=ps.get_tensor_model_parallel_group(),
                src=ps.get_tensor_model_parallel_src_rank(), device=device)
        else:
            raw = next(data_iterator)
            batch = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                     for k, v in raw.items()}
        batch = {k: batch.get(k) for k in
                 ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")}
        documents = self.documents(batch["tokens"], args)
        if args.context_parallel_size > 1:
            batch = cp_split(batch, ps.get_context_parallel_group())
        return (batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"],
                batch["position_ids"], documents)

    @staticmethod
    def loss_func(loss_mask: Any, output_tensor: Any) -> tuple:
        """Summed masked loss, its token count and the report Megatron averages."""
        import torch

        losses = output_tensor.float().reshape(-1)
        mask = loss_mask.float().reshape(-1)
        loss = torch.sum(losses * mask)
        num_tokens = mask.sum().detach().to(torch.int)
        report = {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}
        return loss, num_tokens, report

    def forward_step(self, data_iterator: Any, model: Any, *_: Any, **__: Any) -> tuple:
        """One micro-batch: the model's per-token loss and the loss function."""
        self.check_model(model)  # the 0.19+ builder path builds without model_provider
        self.mask_vocab(model)
        tokens, labels, loss_mask, attention_mask, position_ids, documents = \
            self.get_batch(data_iterator)
        extra = {} if documents is None else {"packed_seq_params": documents}
        out = model(tokens, position_ids, attention_mask, labels=labels, **extra)
        return out, partial(self.loss_func, loss_mask)


def run(ns: argparse.Namespace, user_spec: Any = None) -> None:
    """Call ``megatron.training.pretrain`` with HLA (sys.argv holds Megatron's flags)."""
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    providers = MegatronProviders(ns, user_spec)
    datasets = partial(MegatronProviders.datasets_provider, providers)
    datasets.is_distributed = True  # type: ignore[attr-defined]  # as Megatron's script says
    route = pretrain_api(pretrain)
    compat.prebuilt_dataset_helpers()
    print(f"> megatron.training.pretrain: the {route!r} API", flush=True)
    if route == "legacy":  # <= 0.17: pretrain parses the flags itself
        pretrain(datasets, providers.model_provider, ModelType.encoder_or_decoder,
                 providers.forward_step, extra_args_provider=extra_args,
                 args_defaults=ARGS_DEFAULTS)
        return
    # 0.18 and 0.19+: the flags are parsed here into a config container.
    from megatron.training import argument_utils
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=extra_args, args_defaults=ARGS_DEFAULTS)
    check_hla_args(args)
    check_args(args, providers.route)
    if route == "provider":  # 0.18: the container, then the usual providers
        cfg = argument_utils.pretrain_cfg_container_from_args(args)
        pretrain(cfg, datasets, providers.model_provider, ModelType.encoder_or_decoder,
                 providers.forward_step)
        return
    # 0.19+: the spec goes into the model config, whose builder makes the model;
    # forward_step checks it on its first call.
    model_cfg = argument_utils.gpt_config_from_args(args)
    model_cfg.transformer_layer_spec = layer_spec_from_args(args, user_spec)
    cfg = argument_utils.pretrain_cfg_container_from_args(args, model_cfg)
    pretrain(cfg, datasets, ModelType.encoder_or_decoder, providers.forward_step)


# a % that is not argparse's own %(name)s nor an escaped %%: "...10%)" in one of
# Megatron's help strings (megatron-core 0.18/0.19) makes argparse's help raise ValueError
_PERCENT = re.compile(r"%%|%\(\w+\)[a-z]|%")


def escape_help(text: str | None) -> str | None:
    """``text`` with every stray % doubled, so that argparse can format it."""
    if not text:
        return text
    return _PERCENT.sub(lambda m: m.group(0) if len(m.group(0)) > 1 else "%%", text)


@contextlib.contextmanager
def help_fixes() -> Iterator[None]:
    """While Megatron prints its help: stray % escaped in every help string, and the HLA
    flags added to a Megatron parser that lacks them (some versions parse ``--help``
    before the extra_args_provider has run)."""
    original = argparse.ArgumentParser.format_help

    def format_help(self: argparse.ArgumentParser) -> str:
        opts = self._option_string_actions
        if "--num-layers" in opts and "--attention" not in opts:
            extra_args(self)
        for action in self._actions:
            action.help = escape_help(action.help)
        return original(self)

    argparse.ArgumentParser.format_help = format_help  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.format_help = original  # type: ignore[method-assign]


def hla_help() -> str:
    """The HLA flags alone (what --help shows where megatron.training is missing)."""
    p = argparse.ArgumentParser(
        prog="python -m hla_sp.megatron_patch.pretrain_gpt",
        usage="%(prog)s <Megatron-LM pretrain_gpt flags> --attention hla2 [--hla-* ...]",
        description="Megatron-LM's pretrain_gpt with HLA core attention. Megatron's own flags "
                    "are listed when megatron.training imports.", add_help=False)
    return extra_args(p).format_help()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        return _help(argv)
    try:
        # the user's operators first: they are --attention's choices (each worker runs this)
        import_custom(custom_imports(argv))
        compat.check_version("hla_sp.megatron_patch.pretrain_gpt")  # refuse old, warn new
        ns = prescan(argv)
        user_spec = None
        if ns.spec and not hla_enabled(ns) and ns.spec != ["local"]:
            user_spec = resolve_spec(ns.spec)
            check_args(ns, hla_route(ns, user_spec))
    except ValueError as e:
        print(f"hla_sp.megatron_patch.pretrain_gpt: error: {e}", file=sys.stderr)
        return EXIT_BAD_FLAGS
    try:
        importlib.import_module("megatron.training")
    except ImportError as e:
        print(missing_training_message(e), file=sys.stderr)
        return EXIT_NO_MEGATRON_TRAINING
    if ns.spec == ["local"] and not hla_enabled(ns):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        user_spec = get_gpt_layer_local_spec()
    sys.argv = [sys.argv[0], *argv]  # Megatron parses sys.argv itself
    run(ns, user_spec)
    return 0


def _help(argv: list[str]) -> int:
    """Megatron's help with the HLA flags; the HLA flags alone without megatron.training."""
    try:
        importlib.import_module("megatron.training")
    except ImportError as e:
        print(hla_help())
        print(missing_training_message(e).replace("Nothing was run.", "Megatron's own flags "
                                                  "are not listed here."))
        return 0
    from megatron.training.arguments import parse_args as megatron_parse_args

    sys.argv = [sys.argv[0], *argv]
    with help_fixes():
        try:  # Megatron's parser prints its help and exits 0 on --help
            megatron_parse_args(extra_args_provider=extra_args)
        except SystemExit as e:
            return int(e.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``hla-sp export``: a checkpoint of ``hla-sp train`` as a Hugging Face model directory.

    hla-sp export --load CKPT [--ckpt-step N] --output DIR [--dtype fp32|bf16]
                  [--custom-import MODULE] [--force] [--no-verify]

The checkpoint is loaded as ``hla-sp generate`` loads it (one process: the pieces of
whole tensors that any TP, CP or DP size saved, SHA-256-verified), converted by
:mod:`hla_sp.launch.export.hf_convert` and written as::

    DIR/config.json               HLASPConfig: the architecture and every HLA option;
                                  auto_map names the code files below
    DIR/model.safetensors         whole tensors, Megatron's padded vocabulary rows dropped,
                                  the tied output layer stored once
    DIR/generation_config.json    the end of document as eos (and bos, pad)
    DIR/tokenizer_config.json ... the run's tokenizer (bytes: HLASPByteTokenizer)
    DIR/configuration_hla_sp.py   short modules importing the installed ``hla_sp.hf``
    DIR/modeling_hla_sp.py        (for ``trust_remote_code=True``: the code is the
    DIR/tokenization_hla_sp.py    package's, never a copy that could drift from it)

The directory is written beside DIR first and renamed into place once complete, so an
interrupted export leaves nothing half-written under DIR. An existing non-empty DIR is
refused unless ``--force`` is given and DIR holds an earlier export (its config.json has
``model_type`` ``hla_sp``), which is then replaced whole; any other directory is never
touched. A symbolic link DIR is followed (the export goes where it points). Before the
rename the written directory is loaded back through ``AutoModelForCausalLM`` and its
logits on a probe sequence are compared with the checkpoint's model; non-finite logits
are refused, naming which model gave them (``--no-verify`` skips the comparison, and
also reads a checkpoint whose manifest.json is missing, unverified). A checkpoint
recorded non-finite is refused either way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import warnings
from importlib.metadata import version
from types import ModuleType

import torch
from hla_sp.launch.config.flags import OneLineParser
from hla_sp.launch.config.train_config import ConfigError
from hla_sp.launch.data.tokenizer import load_run_tokenizer
from hla_sp.launch.export.generate import GenerateError, load_model, max_positions
from hla_sp.launch.export.hf_convert import ConvertError, hf_config_from_train, hf_state_dict
from hla_sp.launch.progress import Progress

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# the probe of --verify: its length (at most the learned positions) and its seed
PROBE_TOKENS, PROBE_SEED = 64, 0
# --verify's bound on |HF logits - checkpoint logits| / max |logit|. Both models run the
# same fp32 operations on the same weights in possibly different summation orders
# (about 1e-6 relative measured on the tests' models); a misplaced or missing tensor
# moves the logits by their own size.
VERIFY_REL = 1e-4

# auto_map: transformers' Auto class -> "module.Class" in DIR (the files CODE writes)
AUTO_MAP = {
    "AutoConfig": "configuration_hla_sp.HLASPConfig",
    "AutoModel": "modeling_hla_sp.HLASPModel",
    "AutoModelForCausalLM": "modeling_hla_sp.HLASPForCausalLM",
}
BYTE_TOKENIZER = "HLASPByteTokenizer"
TOKENIZER_MAP = ["tokenization_hla_sp.HLASPByteTokenizer", None]  # (slow, fast)
CODE = {
    "configuration_hla_sp.py": ("hla_sp.hf.configuration", ["HLASPConfig"]),
    "modeling_hla_sp.py": ("hla_sp.hf.modeling", ["HLASPForCausalLM", "HLASPModel"]),
    "tokenization_hla_sp.py": ("hla_sp.hf.tokenization", ["HLASPByteTokenizer"]),
}


# what a machine without hla-sp reads on loading an export (docs/eval.md, "Anywhere else")
MISSING = (f"this model's code is hla-sp's: pip install \"hla_sp-{version('hla-sp')}-py3-none-any"
           f".whl[hf]\" (make wheel in an hla-sp checkout builds it; docs/eval.md)")


class ExportError(RuntimeError):
    """A request or checkpoint export cannot serve; the message is one line."""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="hla-sp export", allow_abbrev=False,
        description="Write a checkpoint of hla-sp train as a Hugging Face model directory "
                    "(config.json, model.safetensors, the tokenizer, the modeling code), "
                    "loadable with AutoModelForCausalLM.from_pretrained(DIR, "
                    "trust_remote_code=True) and lm_eval --model hf.")
    p.add_argument("--load", required=True, metavar="CKPT",
                   help="Checkpoint directory (hla-sp train --save), of any TP/CP/DP size.")
    p.add_argument("--ckpt-step", type=int, default=None, metavar="N",
                   help="Export this iteration instead of the latest.")
    p.add_argument("--output", required=True, metavar="DIR",
                   help="The model directory to write (new or empty; see --force).")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="The weights' dtype in model.safetensors (default: fp32, the "
                        "checkpoint's values exactly; bf16 halves the size).")
    p.add_argument("--custom-import", action="append", default=[], metavar="MODULE",
                   help="Import this module first (one that registers an operator); the "
                        "modules the training run named are imported anyway. Loading the "
                        "exported model needs them imported too.")
    p.add_argument("--force", action="store_true",
                   help="Replace an earlier export in --output (a directory whose "
                        "config.json has model_type hla_sp); other directories are refused.")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="Load the written model back and compare its logits with the "
                        "checkpoint's model (default: on).")
    return p


def check_output(output: str, force: bool) -> None:
    """``--output`` is a new or empty directory, or (with ``force``) an earlier export."""
    if os.path.lexists(output) and not os.path.isdir(output):
        raise ExportError(f"--output {output}: expected a directory (new or empty), got a "
                          f"file")
    if os.path.isdir(output) and os.listdir(output):
        config = os.path.join(output, "config.json")
        try:
            with open(config) as f:
                earlier = json.load(f).get("model_type") == "hla_sp"
        except (OSError, ValueError, AttributeError):
            earlier = False
        if not force:
            raise ExportError(f"--output {output}: expected a new or empty directory, got one "
                              f"holding {len(os.listdir(output))} entries"
                              + ("; --force replaces this earlier export" if earlier else ""))
        if not earlier:
            raise ExportError(f"--output {output} --force: expected an earlier export there "
                              f"(config.json with model_type hla_sp), got a directory of "
                              f"other files; it is left untouched")
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise ExportError(f"--output {output}: its parent directory {parent} does not exist")
    # the export is written beside DIR and renamed into place: the parent must take both
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"--output {output}: its parent directory {parent} is not writable "
                          f"(the export is written beside it, then renamed); choose a "
                          f"writable place")


def resolve_output(output: str) -> str:
    """``--output`` as written to: a symbolic link is followed (the export goes where it
    points, and the link stays), so that the link is never replaced by a directory."""
    output = output.rstrip(os.sep) or output
    return os.path.realpath(output) if os.path.islink(output) else output


def _write_code(out: str, byte_tokenizer: bool) -> None:
    """The modules auto_map names: each re-exports the installed package's classes."""
    for name, (module, classes) in CODE.items():
        if name.startswith("tokenization") and not byte_tokenizer:
            continue
        names = ", ".join(f'"{c}"' for c in classes)
        # transformers' check_imports skips imports inside try: a machine without hla-sp
        # then reads the except's one line on how to install it, not a list of packages
        with open(os.path.join(out, name), "w") as f:
            f.write('"""hla-sp for transformers (trust_remote_code=True): the classes of the '
                    'installed\npackage, not a copy of them."""\n\ntry:\n'
                    f"    from {module} import {', '.join(classes)}\n"
                    "except ImportError as e:\n"
                    f"    if e.name not in ({module!r}, 'hla_sp', 'hla_sp.hf'):\n"
                    "        raise\n"
                    f"    raise ImportError({MISSING!r}) from None\n\n"
                    f"__all__ = [{names}]\n")


def _probe(vocab: int, positions: int | None) -> torch.Tensor:
    """The token ids [1, T] both models are run on: seeded, drawn from the tokenizer's ids."""
    n = PROBE_TOKENS if positions is None else min(PROBE_TOKENS, positions)
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(PROBE_SEED))


def write_export(args: argparse.Namespace, out: str) -> str:
    """Load the checkpoint, write the HF directory into ``out`` (a fresh directory) and,
    with ``args.verify``, check it; returns the summary line. Call inside
    :func:`hla_sp.launch.export.generate.single_process`."""

    dtype = DTYPES[args.dtype]
    # stages: read the checkpoint, write the directory, (verify) load it back and compare
    bar = Progress("export", 3 if args.verify else 2, "stages")
    model, cfg = load_model(args.load, args.ckpt_step, decodable=False)
    bar.advance(note="writing the model directory")
    tok = load_run_tokenizer(cfg)
    # the model's vocabulary, not the tokenizer's when --vocab-size exceeded it: the ids
    # above the tokenizer's were trained (to improbability) and share the softmax
    vocab = cfg.model.vocab_size or tok.vocab_size
    try:
        hf_config = hf_config_from_train(cfg, vocab, tok.eod)
        state = hf_state_dict(model, hf_config)
    except ConvertError as e:
        raise ExportError(f"--load {args.load}: {e}") from None
    state = {k: v.to(dtype).contiguous() for k, v in state.items()}
    byte_tok = _save_files(out, hf_config, state, tok, args.dtype)
    del state
    bar.advance(note="checking its logits")
    m = cfg.model
    summary = (f"{m.attention} GPT, {m.num_layers} layers x {m.hidden_size} hidden, "
               f"vocabulary {vocab} ({'bytes' if byte_tok else tok.name}), "
               f"{args.dtype}")
    if not args.verify:
        bar.close()
        return summary
    # the reference: the checkpoint's model in fp32 on the weights as exported (rounded to
    # bf16 for --dtype bf16), so that the comparison is exact up to summation order
    model = model.float()
    ids = _probe(tok.vocab_size, max_positions(model))  # ids the tokenizer makes
    from hla_sp.megatron_patch.compat import rotary_on_host

    with torch.no_grad(), rotary_on_host():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
        want = model(ids, torch.arange(ids.shape[1])[None], None)[0, :, :vocab]
    del model
    err = verify(out, ids, want)
    bar.advance()
    bar.close()
    return summary + f"; logits checked: max difference {err:.1e} of the largest"


def _transformers() -> ModuleType:
    """transformers, imported on first use: export's one import of it (the hf extra)."""
    import transformers

    return transformers


def _save_files(out: str, hf_config: object, state: dict[str, torch.Tensor], tok: object,
                dtype: str) -> bool:
    """config.json, model.safetensors, generation_config.json, the tokenizer and the
    code into ``out``; returns whether the tokenizer is the byte-level one."""
    from safetensors.torch import save_file

    tok.save_pretrained(out)  # type: ignore[attr-defined]
    tok_config_path = os.path.join(out, "tokenizer_config.json")
    with open(tok_config_path) as f:
        tok_config = json.load(f)
    byte_tok = tok_config.get("tokenizer_class") == BYTE_TOKENIZER
    auto_map = dict(AUTO_MAP)
    if byte_tok:  # a HF tokenizer of the run needs no code: transformers has its class
        auto_map["AutoTokenizer"] = TOKENIZER_MAP
        tok_config["auto_map"] = {"AutoTokenizer": TOKENIZER_MAP}
        with open(tok_config_path, "w") as f:
            json.dump(tok_config, f, indent=2, sort_keys=True)
            f.write("\n")
    hf_config.architectures = ["HLASPForCausalLM"]  # type: ignore[attr-defined]
    hf_config.auto_map = auto_map  # type: ignore[attr-defined]
    hf_config.dtype = {"fp32": "float32", "bf16": "bfloat16"}[dtype]  # type: ignore[attr-defined]
    hf_config.save_pretrained(out)  # type: ignore[attr-defined]
    eod = hf_config.eod_token_id  # type: ignore[attr-defined]
    _transformers().GenerationConfig(bos_token_id=eod, eos_token_id=eod,
                                     pad_token_id=eod).save_pretrained(out)
    weights = os.path.join(out, "model.safetensors")
    save_file(state, weights, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(weights, 0o666 & ~umask)  # as the other files: safetensors writes it 0600
    _write_code(out, byte_tok)
    return byte_tok


def verify(out: str, ids: torch.Tensor, want: torch.Tensor) -> float:
    """Load ``out`` as transformers would (every tensor placed, none left over) and
    compare its fp32 logits on ``ids`` [1, T] with ``want`` [T, vocab]; returns the
    largest difference relative to the largest logit."""
    import hla_sp.hf  # noqa: F401  (registers the model type with the Auto classes)

    transformers = _transformers()
    hf_logging = transformers.logging

    hf_logging.disable_progress_bar()  # the command prints one line
    try:
        hf, info = transformers.AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.float32, output_loading_info=True)
    finally:
        hf_logging.enable_progress_bar()
    wrong = {k: v for k, v in info.items() if v}
    if wrong:
        raise ExportError(f"--output: the written model does not load whole ({wrong}); "
                          f"nothing was left in place")
    with torch.no_grad():
        got = hf(ids).logits[0]
    if not bool(torch.isfinite(want).all()):
        raise ExportError("--load: the checkpoint's model gives non-finite logits (NaN or "
                          "infinite) on the probe sequence: its weights cannot be used; export "
                          "another iteration (--ckpt-step); nothing was left in place")
    if not bool(torch.isfinite(got).all()):
        raise ExportError("--verify: the exported model gives non-finite logits where the "
                          "checkpoint's are finite (a weight too large for --dtype?); nothing "
                          "was left in place")
    err = float((got - want).abs().max() / want.abs().max())
    if not err <= VERIFY_REL:
        raise ExportError(f"--verify: the exported model's logits differ from the "
                          f"checkpoint's by {err:.2e} of the largest (expected <= "
                          f"{VERIFY_REL:g}); nothing was left in place")
    return err


def _install(tmp: str, output: str) -> None:
    """Move the finished ``tmp`` to ``output``; an earlier export there is removed only
    once the new one is in place."""
    old = None
    if os.path.isdir(output):
        old = f"{output}.old-{os.getpid()}"
        os.rename(output, old)
    os.rename(tmp, output)
    if old is not None:
        shutil.rmtree(old)


def main(argv: list[str] | None = None) -> int:
    """The ``hla-sp export`` command: one summary line on stdout."""

    args = build_parser().parse_args(argv)
    output = resolve_output(args.output)
    tmp = f"{output}.tmp-{os.getpid()}"
    try:
        from hla_sp.launch.extras import installed, require

        require("megatron", "hla-sp export")  # the checkpoint is Megatron's model
        missing = [m for m in ("transformers", "safetensors") if not installed(m)]
        if missing:
            raise ExportError(f"hla-sp export needs {' and '.join(missing)}, which "
                              f"{'is' if len(missing) == 1 else 'are'} not installed: "
                              f'pip install "hla-sp[hf]"')
        from hla_sp.launch.export.generate import _quiet_megatron, single_process
        from hla_sp.megatron_patch.args import import_custom

        try:
            import_custom(args.custom_import)
        except ValueError as e:
            raise ExportError(str(e)) from None
        check_output(output, args.force)
        os.makedirs(tmp)
        from hla_sp.launch.checkpoint import manifest

        try:
            with warnings.catch_warnings(), (manifest.unverified() if not args.verify
                                             else contextlib.nullcontext()):
                _quiet_megatron()
                with single_process():
                    summary = write_export(args, tmp)
            _install(tmp, output)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except (ExportError, GenerateError, ConfigError) as e:  # one line, not a traceback
        print(f"hla-sp export: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a place that changed under the export
        where = f"{e.filename}: " if e.filename else ""
        print(f"hla-sp export: error: {where}{e.strerror or e}; nothing was left in place",
              file=sys.stderr)
        return 2
    print(f"hla-sp export: {output}: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

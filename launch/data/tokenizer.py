"""The run's tokenizer: bytes (the default) or a Hugging Face tokenizer, behind one interface.

    load_tokenizer(None | "bytes" | NAME_OR_PATH) -> RunTokenizer
    load_run_tokenizer(cfg) -> RunTokenizer      # cfg.model.tokenizer, as config.json records it

``bytes``: ids 0..255 are the UTF-8 bytes of the text, 256 (EOD) ends a document. A
Hugging Face tokenizer: a local directory (``save_pretrained``'s files), a bare
``tokenizer.json`` (the ``tokenizers`` library's), or a hub name (downloaded by
``transformers`` into its cache, so on a machine without network only if cached); its
end of sequence token ends a document. Text is encoded without special tokens (no BOS):
documents are separated by EOD alone, in ``make-dataset``, in training and in ``generate``.

``make-dataset`` writes the tokenizer beside the data (``PREFIX.json``: its name, vocabulary
size and EOD); the trainer checks its ``--tokenizer`` and ``--vocab-size`` against that
(:func:`check_data_tokenizer`) and records ``--tokenizer`` in the checkpoint's config.
"""

from __future__ import annotations

import codecs
import functools
import json
import os
from abc import ABC, abstractmethod
from typing import Any, Protocol

from hla_sp.launch.errors import ConfigError
from hla_sp.launch.extras import installed

__all__ = ["BYTES", "RunTokenizer", "StreamDecoder", "TokenizerError", "check_data_tokenizer",
           "check_run_tokenizer", "load_run_tokenizer", "load_tokenizer", "read_sidecar",
           "sidecar_path", "write_sidecar"]

BYTES = "bytes"  # the spec of the byte-level tokenizer
_BYTE_VOCAB, _BYTE_EOD = 257, 256  # as hla_sp.launch.data.indexed_dataset (which imports numpy)
SIDECAR_FORMAT = "hla-sp dataset tokenizer 1"


class TokenizerError(ConfigError):
    """A tokenizer that cannot be loaded or does not fit the run; the message is one line."""


class StreamDecoder(Protocol):
    """Text of ids given one at a time: :meth:`add` returns what became printable (a
    character may take several ids), :meth:`flush` the rest at the end. An end of
    document shows as a new line."""

    def add(self, token: int) -> str: ...

    def flush(self) -> str: ...


class _TextStream:
    """A tokenizer's text decoded in context: the ids since the last printed boundary
    are decoded with the ones before it (a token's text can depend on its neighbour:
    a leading space, a character split over two ids), and only the new part is given."""

    def __init__(self, tok: RunTokenizer):
        self.tok, self.ids = tok, []
        self.prefix = self.read = 0  # ids[prefix:read]: context, already printed

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._new(final=False)

    def flush(self) -> str:
        return self._new(final=True)

    def _new(self, final: bool) -> str:
        before = self.tok.decode(self.ids[self.prefix:self.read])
        text = self.tok.decode(self.ids[self.prefix:])
        # a trailing U+FFFD is a character still incomplete: wait for the next id
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return text[len(before):] if final else ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]


class _ByteStream:
    """The UTF-8 incremental decoder (errors replaced) over the byte ids."""

    def __init__(self) -> None:
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token: int) -> str:
        return self.utf8.decode(bytes([token if token < 256 else 10]))

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True)


class RunTokenizer(ABC):
    """What the launcher needs of a tokenizer: ``name`` (the spec recorded in the run),
    ``vocab_size`` (every id is below it), ``eod`` (the id that ends a document)."""

    name: str
    vocab_size: int
    eod: int

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, without special tokens."""

    def encode_document(self, raw: bytes, where: str) -> list[int]:
        """The ids of one document read from a file (``where`` names it in errors)."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TokenizerError(
                f"{where}: expected UTF-8 text for --tokenizer {self.name}, got byte "
                f"{raw[e.start]:#04x} at offset {e.start} (only the byte-level tokenizer takes "
                f"any bytes)") from None
        return self.encode(text)

    @abstractmethod
    def _decode_part(self, ids: list[int]) -> str:
        """Text of ids that hold no EOD."""

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; each end of document is a new line."""
        parts, start = [], 0
        for i, t in enumerate(ids):
            if t == self.eod:
                parts.append(self._decode_part(ids[start:i]))
                start = i + 1
        parts.append(self._decode_part(ids[start:]))
        return "\n".join(parts)

    def stream(self) -> StreamDecoder:
        """A decoder for ids that arrive one at a time (``hla-sp generate``)."""
        return _TextStream(self)

    @abstractmethod
    def save_pretrained(self, directory: str) -> list[str]:
        """Write this tokenizer's Hugging Face files into ``directory``; their paths."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab {self.vocab_size}, EOD {self.eod})"


class ByteTokenizer(RunTokenizer):
    """UTF-8 bytes, ids 0..255; EOD 256."""

    name, vocab_size, eod = BYTES, _BYTE_VOCAB, _BYTE_EOD

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_document(self, raw: bytes, where: str) -> list[int]:
        return list(raw)  # any bytes: nothing to decode first

    def _decode_part(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def stream(self) -> StreamDecoder:
        return _ByteStream()

    def save_pretrained(self, directory: str) -> list[str]:
        _require_transformers()
        from hla_sp.hf.tokenization import HLASPByteTokenizer

        return list(HLASPByteTokenizer().save_pretrained(directory))


class HFTokenizer(RunTokenizer):
    """A ``transformers`` tokenizer; EOD is its end of sequence token."""

    def __init__(self, name: str, tok: Any):
        if tok.eos_token_id is None:
            raise TokenizerError(
                f"--tokenizer {name}: expected a tokenizer with an end of sequence token (it "
                f"ends each document), got {type(tok).__name__} without eos_token; set one "
                f"(tokenizer.eos_token = ...) and save_pretrained it")
        self.name, self.tok = name, tok
        self.vocab_size = len(tok)  # added tokens too: their ids follow the base vocabulary
        self.eod = int(tok.eos_token_id)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def _decode_part(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)) if ids else ""

    def save_pretrained(self, directory: str) -> list[str]:
        return list(self.tok.save_pretrained(directory))


def _require_transformers() -> None:
    if not installed("transformers"):
        raise TokenizerError('--tokenizer: a Hugging Face tokenizer needs transformers, which '
                             'is not installed: pip install "hla-sp[hf]"')


def _is_path(spec: str) -> bool:
    """A spec that can only be a path (a hub name is NAME or ORG/NAME)."""
    return os.path.isabs(spec) or spec.startswith(("./", "../", "~", ".\\")) or os.path.exists(
        spec)


def load_tokenizer(spec: str | None) -> RunTokenizer:
    """The tokenizer a ``--tokenizer`` value names: None or "bytes", a local directory or
    tokenizer.json, or a hub name; a one-line :class:`TokenizerError` when it cannot be
    loaded. A local path is recorded (``name``) as an absolute path."""
    if spec is None or spec == BYTES:
        return ByteTokenizer()
    if not isinstance(spec, str) or not spec.strip():
        raise TokenizerError(f"--tokenizer: expected 'bytes', a path or a hub name, got {spec!r}")
    if _is_path(spec):
        path = os.path.abspath(os.path.expanduser(spec))
        if not os.path.exists(path):
            raise TokenizerError(f"--tokenizer {spec}: no such file or directory (expected "
                                 f"'bytes', a tokenizer directory or tokenizer.json, or a hub "
                                 f"name)")
        return _load_hf(path)
    return _load_hf(spec)


@functools.lru_cache(maxsize=8)  # the launcher's checks and the run read it several times
def _load_hf(name: str) -> RunTokenizer:
    _require_transformers()
    import transformers

    import hla_sp.hf  # noqa: F401  (AutoTokenizer then knows HLASPByteTokenizer's files)

    try:
        if os.path.isfile(name):
            tok = transformers.PreTrainedTokenizerFast(tokenizer_file=name)
            # a bare tokenizer.json names no eos: its one special token ends a document
            special = [t.content for t in tok.added_tokens_decoder.values() if t.special]
            if len(special) != 1:
                raise TokenizerError(
                    f"--tokenizer {name}: a bare tokenizer.json does not say which token ends "
                    f"a document; expected exactly one special token in it, got "
                    f"{len(special)} ({', '.join(special[:4]) or 'none'}); save it with "
                    f"transformers' save_pretrained with eos_token set")
            tok.eos_token = special[0]
        else:
            tok = transformers.AutoTokenizer.from_pretrained(name)
    except TokenizerError:
        raise
    except Exception as e:  # network, missing files, a format transformers does not read
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise TokenizerError(
            f"--tokenizer {name}: cannot load it ({type(e).__name__}: {first}); expected "
            f"'bytes', a tokenizer directory or tokenizer.json, or a hub name (without "
            f"network only one already in the Hugging Face cache)") from None
    return HFTokenizer(name, tok)


def load_run_tokenizer(cfg: Any) -> RunTokenizer:
    """The tokenizer of a run (``cfg.model.tokenizer``; None: bytes), checked to fit its
    ``vocab_size`` (None: the byte vocabulary)."""
    tok = load_tokenizer(cfg.model.tokenizer)
    vocab = cfg.model.vocab_size or _BYTE_VOCAB
    if tok.vocab_size > vocab:
        raise TokenizerError(
            f"--tokenizer {tok.name}: its vocabulary ({tok.vocab_size}) does not fit the "
            f"model's --vocab-size {vocab}; expected a tokenizer of at most {vocab} ids")
    return tok


def check_run_tokenizer(cfg: Any) -> None:
    """``--tokenizer`` loads; ``--vocab-size`` defaults to its vocabulary and holds it.

    Sets ``cfg.model.vocab_size`` (when unset) and ``cfg.model.tokenizer`` (a local path made
    absolute), so the model, the data checks and the checkpoint's config.json all see
    the resolved values."""
    if cfg.model.tokenizer is None:
        return
    tok = load_tokenizer(cfg.model.tokenizer)
    cfg.model.tokenizer = tok.name
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = tok.vocab_size
    if tok.vocab_size > cfg.model.vocab_size:
        raise TokenizerError(
            f"--vocab-size: expected at least {tok.vocab_size} (the vocabulary of --tokenizer "
            f"{tok.name}), got {cfg.model.vocab_size}")
    if tok.name != BYTES and cfg.data.data == "text" and not cfg.data.data_path:
        raise TokenizerError(
            f"--tokenizer {tok.name}: the built-in text is byte-level; expected --data-path "
            f"with data made by make-dataset --tokenizer {tok.name}, or no --tokenizer")


# --- the data's sidecar -----------------------------------------------------------------


def sidecar_path(prefix: str) -> str:
    """Where ``make-dataset`` records the tokenizer of ``PREFIX.bin``/``.idx``."""
    return prefix + ".json"


def write_sidecar(path: str, tok: RunTokenizer, counts: dict[str, Any]) -> None:
    """The tokenizer record of a dataset (written to ``path`` atomically)."""
    body = {"format": SIDECAR_FORMAT, "tokenizer": tok.name, "vocab_size": tok.vocab_size,
            "eod": tok.eod, **counts}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def read_sidecar(prefix: str) -> dict[str, Any] | None:
    """The tokenizer record of a dataset, or None when it has none (data made by
    Megatron's tools or an older make-dataset)."""
    path = sidecar_path(prefix)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            body = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: cannot read the dataset's tokenizer record "
                             f"({type(e).__name__}: {e})") from None
    if not isinstance(body, dict) or body.get("format") != SIDECAR_FORMAT:
        return None  # some other JSON beside the data: not ours to judge
    for key in ("tokenizer", "vocab_size", "eod"):
        if key not in body:
            raise TokenizerError(f"{path}: expected the key {key!r} in the dataset's "
                                 f"tokenizer record, got {sorted(body)}")
    return body


def check_data_tokenizer(prefix: str, cfg: Any) -> None:
    """The run's ``--tokenizer`` and ``--vocab-size`` against the tokenizer that made
    ``prefix`` (its sidecar); one line naming the flag, the data's value and the run's."""
    data = read_sidecar(prefix)
    if data is None:
        return
    run = load_tokenizer(cfg.model.tokenizer)
    where = sidecar_path(prefix)
    if (data["tokenizer"], data["vocab_size"], data["eod"]) != (run.name, run.vocab_size,
                                                                 run.eod):
        default = " (the default)" if cfg.model.tokenizer is None else ""
        raise TokenizerError(
            f"--tokenizer: expected {data['tokenizer']} (vocabulary {data['vocab_size']}, EOD "
            f"{data['eod']}), which made --data-path {prefix} ({where}), got {run.name}"
            f"{default} (vocabulary {run.vocab_size}, EOD {run.eod})")
    vocab = cfg.model.vocab_size or _BYTE_VOCAB
    if vocab < data["vocab_size"]:
        raise TokenizerError(
            f"--vocab-size: expected at least {data['vocab_size']} (the vocabulary of "
            f"{data['tokenizer']}, which made --data-path {prefix}), got {vocab}")

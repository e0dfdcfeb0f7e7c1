"""Text files to a Megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``).

    hla-sp make-dataset --input a.txt docs/ --output-prefix data/corpus [--tokenizer NAME]

Each file is one document: its tokens followed by the tokenizer's end of document. The
default tokenizer is bytes: the file's bytes (ids 0..255), then EOD (256).
``--tokenizer`` takes a Hugging Face tokenizer instead (a directory, a tokenizer.json or
a hub name: :mod:`hla_sp.launch.data.tokenizer`); its end of sequence token ends each
document. With ``--split-lines`` each non-empty line is a document instead.
Directories are walked (``--suffix`` filters). Ids are stored in the smallest dtype
that holds the vocabulary (uint8, uint16 or int32), and ``PREFIX.json`` records the
tokenizer, its vocabulary and EOD, which the trainer checks ``--tokenizer`` and
``--vocab-size`` against. The pair is read by Megatron's ``IndexedDataset`` (and
``pretrain_gpt``) and by ``--data-path data/corpus``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import numpy as np
import torch
from hla_sp.launch.config.flags import OneLineParser, plain
from hla_sp.launch.data.datasets import EOD
from hla_sp.launch.data.indexed_dataset import megatron_datasets
from hla_sp.launch.data.tokenizer import (
    BYTES,
    RunTokenizer,
    TokenizerError,
    load_tokenizer,
    sidecar_path,
    write_sidecar,
)
from hla_sp.launch.progress import Progress


def iter_files(inputs: list[str], suffixes: list[str] | None) -> Iterator[str]:
    """Files named, and files under directories sorted by relative path."""
    for path in inputs:
        if os.path.isdir(path):
            found = [
                os.path.join(dirpath, f)
                for dirpath, _, filenames in os.walk(path)
                for f in filenames
                if not suffixes or any(f.endswith(s) for s in suffixes)
            ]
            # sorted by relative path, so the order is the same on every machine
            yield from sorted(found, key=lambda p: os.path.relpath(p, path).split(os.sep))
        elif os.path.isfile(path):
            yield path
        else:
            raise FileNotFoundError(f"--input {path}: no such file or directory")


def encode(text: bytes) -> np.ndarray:
    """Byte-level tokens of one document, EOD appended (the default tokenizer)."""
    return np.concatenate([np.frombuffer(text, dtype=np.uint8).astype(np.uint16), [EOD]])


def decode(tokens: np.ndarray) -> bytes:
    """Inverse of :func:`encode` (EOD dropped)."""
    t = np.asarray(tokens)
    return t[t != EOD].astype(np.uint8).tobytes()


def token_dtype(vocab_size: int) -> type:
    """The smallest dtype of Megatron's indexed datasets that holds ids below ``vocab_size``."""
    for dtype in (np.uint8, np.uint16):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return dtype
    return np.int32


def make_dataset(
    inputs: list[str],
    output_prefix: str,
    split_lines: bool = False,
    suffixes: list[str] | None = None,
    tokenizer: str | RunTokenizer | None = None,
    show_progress: bool = False,
) -> dict[str, int]:
    """Write the dataset and its tokenizer record; return counts. The pair appears only
    once both files are complete; the record is in place before it. ``show_progress``:
    bytes read of the inputs' total, with an ETA, on stderr."""
    tok = tokenizer if isinstance(tokenizer, RunTokenizer) else load_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    tmp = f"{output_prefix}.tmp{os.getpid()}"
    paths = list(iter_files(inputs, suffixes))  # a missing input: before anything is written
    builder = megatron_datasets().IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
    docs = tokens = files = 0
    bar = Progress("make-dataset", sum(os.path.getsize(p) for p in paths), "bytes",
                   enabled=show_progress)
    try:
        for path in paths:
            with open(path, "rb") as f:
                raw = f.read()
            files += 1
            pieces = [ln for ln in raw.splitlines() if ln.strip()] if split_lines else [raw]
            for piece in pieces:
                if tok.name == BYTES:  # no list of Python ints per byte of a large file
                    ids = encode(piece).astype(np.int64)
                else:
                    ids = np.array([*tok.encode_document(piece, f"--input {path}"), tok.eod],
                                   dtype=np.int64)
                builder.add_item(torch.from_numpy(ids))
                builder.end_document()
                docs += 1
                tokens += len(ids)
            bar.advance(len(raw))
        bar.close()
        builder.finalize(tmp + ".idx")
    except BaseException:
        for leftover in (tmp + ".bin", tmp + ".idx"):
            if os.path.exists(leftover):
                os.remove(leftover)
        raise
    counts = {"files": files, "documents": docs, "tokens": tokens}
    write_sidecar(sidecar_path(output_prefix), tok,
                  {**counts, "dtype": np.dtype(dtype).name})
    # write-then-rename, .bin first: a reader that finds the .idx finds a complete .bin
    os.replace(tmp + ".bin", output_prefix + ".bin")
    os.replace(tmp + ".idx", output_prefix + ".idx")
    return counts


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="hla-sp make-dataset", allow_abbrev=False,
                      description=plain(__doc__.split("\n")[0]))
    p.add_argument("--input", nargs="+", required=True, help="Text files or directories.")
    p.add_argument("--output-prefix", required=True,
                   help="Writes PREFIX.bin, PREFIX.idx and PREFIX.json (the tokenizer).")
    p.add_argument("--split-lines", action="store_true", help="One document per non-empty line.")
    p.add_argument(
        "--suffix", nargs="*", default=None, help="Only files ending so (in directories)."
    )
    p.add_argument("--tokenizer", default=None, metavar="NAME_OR_PATH",
                   help="bytes (the default: UTF-8 bytes, vocabulary 257, EOD 256), or a "
                        "Hugging Face tokenizer: a directory of its files, a tokenizer.json, "
                        "or a hub name (downloaded unless cached); its eos token ends each "
                        "document. Train with the same --tokenizer.")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        tok = load_tokenizer(a.tokenizer)  # before any file is read or written
        counts = make_dataset(a.input, a.output_prefix, a.split_lines, a.suffix, tok,
                              show_progress=True)
        if counts["documents"] == 0:
            raise FileNotFoundError("--input: no documents found")
    except (FileNotFoundError, TokenizerError) as e:
        print(f"hla-sp make-dataset: error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {a.output_prefix}.bin/.idx: {counts['files']} files, {counts['documents']} "
        f"documents, {counts['tokens']} tokens (tokenizer {tok.name}, vocab {tok.vocab_size}, "
        f"EOD = {tok.eod}; recorded in {sidecar_path(a.output_prefix)})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

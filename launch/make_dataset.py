"""Text files to a Megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), byte-level.

    python -m hla_sp.launch.make_dataset --input a.txt docs/ --output-prefix data/corpus

Each file is one document: its UTF-8 bytes (ids 0..255) followed by EOD (256). With
``--split-lines`` each non-empty line is a document instead. Directories are walked
(``--suffix`` filters). The result is read by Megatron's ``IndexedDataset`` and by
``--data-path data/corpus``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator

import numpy as np
import torch
from hla_sp.launch.data import EOD


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
    """Byte-level tokens of one document, EOD appended."""
    return np.concatenate([np.frombuffer(text, dtype=np.uint8).astype(np.uint16), [EOD]])


def decode(tokens: np.ndarray) -> bytes:
    """Inverse of :func:`encode` (EOD dropped)."""
    t = np.asarray(tokens)
    return t[t != EOD].astype(np.uint8).tobytes()


def make_dataset(
    inputs: list[str],
    output_prefix: str,
    split_lines: bool = False,
    suffixes: list[str] | None = None,
) -> dict[str, int]:
    """Write the dataset; return counts. The pair appears only once both files are complete."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    tmp = f"{output_prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=np.uint16)
    docs = tokens = files = 0
    for path in iter_files(inputs, suffixes):
        with open(path, "rb") as f:
            raw = f.read()
        files += 1
        pieces = [ln for ln in raw.splitlines() if ln.strip()] if split_lines else [raw]
        for piece in pieces:
            arr = encode(piece)
            builder.add_item(torch.from_numpy(arr.astype(np.int64)))
            builder.end_document()
            docs += 1
            tokens += len(arr)
    builder.finalize(tmp + ".idx")
    # write-then-rename, .bin first: a reader that finds the .idx finds a complete .bin
    os.replace(tmp + ".bin", output_prefix + ".bin")
    os.replace(tmp + ".idx", output_prefix + ".idx")
    return {"files": files, "documents": docs, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="hla_sp.launch.make_dataset", description=__doc__.split("\n")[0]
    )
    p.add_argument("--input", nargs="+", required=True, help="Text files or directories.")
    p.add_argument("--output-prefix", required=True, help="Writes PREFIX.bin and PREFIX.idx.")
    p.add_argument("--split-lines", action="store_true", help="One document per non-empty line.")
    p.add_argument(
        "--suffix", nargs="*", default=None, help="Only files ending so (in directories)."
    )
    a = p.parse_args(argv)
    try:
        counts = make_dataset(a.input, a.output_prefix, a.split_lines, a.suffix)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if counts["documents"] == 0:
        print("error: no documents found in --input", file=sys.stderr)
        return 2
    print(
        f"wrote {a.output_prefix}.bin/.idx: {counts['files']} files, {counts['documents']} "
        f"documents, {counts['tokens']} tokens (byte-level, vocab 257, EOD = {EOD})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every file of a checkpoint, its size and its SHA-256, in ``manifest.json``.

A save records each file it wrote, with the iteration, before the directory gets its
``iter_`` name; a load verifies the files against it before reading any of them, so a
flipped byte, a truncated shard or a ``model_optim/`` copied in from another iteration
is refused in one line naming the file (:class:`CheckpointError`), not loaded as
weights of 1e37 or met as a traceback from deep inside DCP.

Who digests: each rank digests the files it wrote itself (its DCP shards
``model_optim/__R_*.distcp`` and its ``rng_rankRRRRR.pt``; rank 0 also ``common.pt``,
``config.json`` and DCP's ``.metadata``), right after writing them, while they are
likely still in its page cache; the lists are gathered to rank 0, which writes the
manifest. Rank 0 reading every rank's files instead would serialize a multi-node
checkpoint's whole size through one node's link and disk. The gather also ends the save
on every rank, so the manifest is complete before the rename. Anything in the directory
that no rank claimed (a file name DCP might use in another version) rank 0 digests
itself, so the manifest lists every file whatever the naming.

SHA-256 (hashlib, SHA-NI on current x86): 1.25 GiB/s on one core of the 2-core CI
machine, against 6.6 for zlib's CRC-32 and 1.06 for BLAKE2b (2026-12-04). CRC-32 would
be faster, but SHA-256 is what ``sha256sum`` checks by hand, and a load verifies in
parallel: each rank digests a share of the files. Measured cost:
``benchmarks/bench_ckpt_verify.py`` (figures in docs/launch.md, "Checkpoints").

A checkpoint without a manifest is refused when its format always writes one
(``common.pt`` records format 3 or later: the manifest was deleted or lost, and a resume
would otherwise write a fresh manifest certifying whatever is there); one of format 2
or the first format may predate manifests and loads with a one-line warning, as does
any within :func:`unverified` (``hla-sp export --no-verify``). The manifest also
records whether the checkpoint is finite and its iteration's loss.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import math
import os
import zlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from hla_sp.launch.checkpoint.layout import (
    COMMON,
    CONFIG,
    SHARDED,
    CheckpointError,
    atomic_write_bytes,
    complete_iterations,
    iter_dir,
    warn_once,
)

MANIFEST = "manifest.json"
# common.pt's "format" from which every save writes a manifest: a checkpoint of this
# format or later without one lost it (refused); an older one may predate manifests
FIRST_FORMAT_WITH_MANIFEST = 3
ALGORITHM = "sha256"
_BLOCK = 4 << 20
_HINT = "resume from another iteration with --ckpt-step"


def digest(path: str, algorithm: str | None = None) -> tuple[int, str]:
    """(size in bytes, hex digest) of one file, read in 4 MiB blocks; ``algorithm`` is
    a hashlib name or ``crc32`` (zlib's), default :data:`ALGORITHM`."""

    algorithm = algorithm or ALGORITHM
    h = None if algorithm == "crc32" else hashlib.new(algorithm)
    crc = 0
    size = 0
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            if h is None:
                crc = zlib.crc32(view[:n], crc)
            else:
                h.update(view[:n])
            size += n
    return size, f"{crc:08x}" if h is None else h.hexdigest()


def rank_files(d: str, rank: int) -> list[str]:
    """The files rank ``rank`` wrote into the checkpoint directory ``d`` (relative
    paths): its RNG file and DCP shards; rank 0 also the common, config and DCP index
    files. DCP names a rank's data files ``__<rank>_<n>.distcp``."""
    out = [f"rng_rank{rank:05d}.pt"]
    shards = glob.glob(os.path.join(glob.escape(os.path.join(d, SHARDED)), f"__{rank}_*"))
    out += sorted(os.path.relpath(p, d) for p in shards)
    if rank == 0:
        out += [COMMON, CONFIG, os.path.join(SHARDED, ".metadata")]
    return [p for p in out if os.path.isfile(os.path.join(d, p))]


def digest_files(d: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size", "sha256"}}`` for ``names`` under ``d``."""
    out = {}
    for name in names:
        size, hexdigest = digest(os.path.join(d, name), ALGORITHM)
        out[name.replace(os.sep, "/")] = {"size": size, ALGORITHM: hexdigest}
    return out


def _all_files(d: str) -> list[str]:
    out = []
    for base, _, files in os.walk(d):
        out += [os.path.relpath(os.path.join(base, f), d) for f in files]
    return sorted(out)


def write(d: str, iteration: int, entries: dict[str, dict[str, Any]], finite: bool,
          loss: float | None = None) -> None:
    """Rank 0, after every rank's files and digests: write ``d/manifest.json``; files
    that no rank claimed are digested here. ``finite``: the run's last loss, gradient
    norm and every saved tensor were finite (what ``--keep-last`` protects, and what
    every reader requires); ``loss``: the iteration's loss (the lowest-loss finite
    checkpoint is kept as well)."""
    from hla_sp.launch.checkpoint.operator_digest import digests

    entries = dict(entries)
    rest = [f for f in _all_files(d) if f.replace(os.sep, "/") not in entries and f != MANIFEST]
    entries.update(digest_files(d, rest))
    body = {"iteration": iteration, "algorithm": ALGORITHM, "finite": finite,
            "loss": loss if loss is not None and math.isfinite(loss) else None,
            "operators": digests(),
            "files": dict(sorted(entries.items()))}  # fmt: skip
    atomic_write_bytes(os.path.join(d, MANIFEST), json.dumps(body, indent=1).encode())


def read(d: str) -> dict[str, Any] | None:
    """The manifest of checkpoint directory ``d``; None if it has none (an older
    checkpoint). A malformed one raises :class:`CheckpointError` naming it."""
    path = os.path.join(d, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            body = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read the checkpoint's file list "
                              f"({type(e).__name__}: {e}); {_HINT}") from None
    files = body.get("files") if isinstance(body, dict) else None
    ok = (isinstance(files, dict) and isinstance(body.get("iteration"), int)
          and all(isinstance(v, dict) and isinstance(v.get("size"), int)
                  and isinstance(v.get(body.get("algorithm")), str)
                  for v in files.values()))  # fmt: skip
    if not ok:
        raise CheckpointError(f"{path}: expected an object with iteration, algorithm and "
                              f"files (size and digest per file), got something else; {_HINT}")
    return body


def is_finite(d: str) -> bool | None:
    """What the manifest of ``d`` says about the run's values when it was saved; None
    when unknown (no manifest, or an unreadable one)."""
    try:
        body = read(d)
    except CheckpointError:
        return None
    return None if body is None or "finite" not in body else bool(body["finite"])


def newest_finite(root: str, at_most: int | None = None) -> int | None:
    """The newest complete checkpoint under ``root`` (at iteration ``at_most`` or before)
    not recorded as non-finite."""
    for it in reversed(complete_iterations(root)):
        if (at_most is None or it <= at_most) and is_finite(iter_dir(root, it)) is not False:
            return it
    return None


def lowest_loss(root: str, at_most: int | None = None) -> tuple[int, float] | None:
    """(iteration, loss) of the finite checkpoint under ``root`` (at ``at_most`` or
    before) with the lowest recorded loss; None when none records one. What a diverging
    run goes back to: ``--keep-last`` keeps it."""
    best: tuple[int, float] | None = None
    for it in complete_iterations(root):
        if at_most is not None and it > at_most:
            continue
        try:
            body = read(iter_dir(root, it))
        except CheckpointError:
            continue
        loss = body.get("loss") if body is not None and body.get("finite") else None
        if isinstance(loss, (int, float)) and (best is None or loss <= best[1]):
            best = (it, float(loss))
    return best


def mark_non_finite(d: str, why: str) -> None:
    """Record checkpoint ``d`` as non-finite after the fact (``why``: what was found);
    the files' digests are unchanged. A manifest that cannot be rewritten (a read-only
    --load) is left as it is."""
    with contextlib.suppress(CheckpointError, OSError):
        body = read(d)
        if body is not None and body.get("finite") is not False:
            body.update(finite=False, non_finite=why)
            atomic_write_bytes(os.path.join(d, MANIFEST), json.dumps(body, indent=1).encode())


def refuse_non_finite(root: str, d: str, iteration: int) -> None:
    """Raise :class:`CheckpointError` in one line when checkpoint ``d`` (iteration
    ``iteration`` under ``root``) is recorded non-finite, naming the newest finite one;
    warn in one line for each registered operator whose source changed since the save.
    Every reader (a resume, generate, eval, export) calls it, after :func:`verify`."""
    try:
        body = read(d)
    except CheckpointError:
        return  # verify() reports a bad manifest
    if body is None:
        return
    from hla_sp.launch.checkpoint.operator_digest import changed

    for line in changed(body.get("operators")):
        warn_once(f"{d}: {line}")
    if body.get("finite") is not False:
        return
    why = body.get("non_finite") or ("its loss, gradient norm or saved tensors were NaN or "
                                     "infinite when it was saved")
    good = newest_finite(root)
    then = (f"the newest finite checkpoint is iteration {good}: pass --ckpt-step {good}"
            if good is not None else f"{root} holds no finite checkpoint")
    raise CheckpointError(f"{d}: recorded non-finite ({why}); refusing to read it; {then}")


_unverified = False


@contextlib.contextmanager
def unverified() -> Iterator[None]:
    """Within the block, a checkpoint whose manifest.json is missing loads with a warning
    (``hla-sp export --no-verify``) instead of being refused."""
    global _unverified
    before, _unverified = _unverified, True
    try:
        yield
    finally:
        _unverified = before


def predates_manifests(d: str) -> str | None:
    """Why checkpoint ``d`` may have been written before manifests existed (its
    ``common.pt`` records format 2, or it is of the first format), or None when its format
    always writes one (3 and later: a missing manifest was deleted or lost)."""
    from hla_sp.launch.checkpoint.layout import LEGACY_MODEL, read_torch_file

    common = os.path.join(d, COMMON)
    if not os.path.isfile(common):
        return ("it is of the first format (model_optim_tpNN.pt), older than manifests"
                if os.path.isfile(os.path.join(d, LEGACY_MODEL)) else None)
    fmt = read_torch_file(common, "iteration, data position, scheduler and optimizer "
                                  "settings").get("format")
    if isinstance(fmt, int) and fmt < FIRST_FORMAT_WITH_MANIFEST:
        return (f"common.pt records format {fmt}; manifests came with format "
                f"{FIRST_FORMAT_WITH_MANIFEST}")
    return None


def _check(d: str, name: str, want: dict[str, Any], algorithm: str, where: str) -> str | None:
    """Why ``d/name`` does not match its manifest entry, or None."""
    path = os.path.join(d, name)
    if not os.path.isfile(path):
        return f"{path}: missing; {where} lists it; {_HINT}"
    size = os.path.getsize(path)
    if size != want["size"]:
        return (f"{path}: {size} bytes, {where} records {want['size']}: the file is truncated, "
                f"corrupt or from another checkpoint; {_HINT}")
    _, got = digest(path, algorithm)
    if got != want[algorithm]:
        return (f"{path}: {algorithm} {got[:16]}..., {where} records "
                f"{want[algorithm][:16]}...: the file is corrupt or from another checkpoint; "
                f"{_HINT}")
    return None


def verify(d: str, iteration: int) -> None:
    """Check every file of checkpoint ``d`` (iteration ``iteration``) against its
    manifest before anything is read; raise :class:`CheckpointError` naming the first
    bad file. Collective when a process group of several ranks exists: each rank
    digests a share of the files and every rank raises the same error (a rank that
    went on into DCP's collective load alone would hang). A checkpoint without a
    manifest is refused, unless its format predates manifests
    (:func:`predates_manifests`) or within :func:`unverified`: then it loads with a
    one-line warning."""
    group = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if group else (0, 1)
    problem: str | None = None
    try:
        body = read(d)
        old = predates_manifests(d) if body is None else None
        if body is None and (old is not None or _unverified):
            how = f"written before files were digested: {old}" if old else "--no-verify"
            warn_once(f"{d}: no {MANIFEST} ({how}); loading it unverified")
        elif body is None:
            problem = (f"{d}: no {MANIFEST}, though its format always writes one (common.pt "
                       f"records format {FIRST_FORMAT_WITH_MANIFEST} or later): it was deleted "
                       f"or lost, so its files cannot be verified; restore it, or {_HINT} "
                       f"(hla-sp export --no-verify reads it unverified)")
        elif body["iteration"] != iteration:
            problem = (f"{os.path.join(d, MANIFEST)}: records iteration {body['iteration']}, "
                       f"expected {iteration} (the directory's); the file is from another "
                       f"checkpoint; {_HINT}")
        else:
            where = f"{MANIFEST} of iteration {iteration}"
            names = sorted(body["files"])
            # a share per rank, by size, so that one large shard is not one rank's tail
            names.sort(key=lambda n: -body["files"][n]["size"])
            for name in names[rank::world]:
                problem = _check(d, name, body["files"][name], body["algorithm"], where)
                if problem:
                    break
    except CheckpointError as e:
        problem = str(e)
    except ValueError as e:  # an unknown algorithm name
        problem = f"{os.path.join(d, MANIFEST)}: {e}; {_HINT}"
    if group:
        found: list[str | None] = [None] * world
        dist.all_gather_object(found, problem)
        problem = next((p for p in found if p), None)
    if problem:
        raise CheckpointError(problem)


def files_bytes(body: dict[str, Any]) -> int:
    """Total size of the files a manifest lists."""
    return sum(int(v["size"]) for v in body["files"].values())

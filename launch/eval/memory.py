"""``hla-sp eval``'s memory plan: what the longest ``--lengths`` needs per rank, checked
against what a rank can have before any process starts, as ``hla-sp train --dry-run``
plans a run.

A rank holds the model's weights (no gradients, no optimizer) and the forward of its
share (1/CP) of one sequence: a layer's working set and the output layer's logits, by
the training memory model's constants (:mod:`hla_sp.launch.model.estimate`). A rank can have
the accelerator's memory on a GPU; on the CPU, its share of the host's available memory,
and no more than the address space a limit (``ulimit -v``) leaves it.
"""

from __future__ import annotations

import resource
from typing import Any

from hla_sp.launch.errors import ConfigError
from hla_sp.launch.model.estimate import (
    FIXED_BYTES,
    GIB,
    LOGIT_BYTES,
    WORKING_SET_PER_WIDTH,
    _element_bytes,
    _layer_params,
    _vocab,
)


def eval_bytes(cfg: Any, length: int, cp: int) -> int:
    """Bytes per rank of the forward of one ``length``-token sequence over ``cp`` ranks
    (``cfg``: the checkpoint's TrainConfig): fixed, weights, working set, logits."""
    m, e = cfg.model, _element_bytes(cfg)
    h, v = m.hidden_size, _vocab(cfg, None)
    pos = ((m.max_position_embeddings or m.seq_length) * h
           if m.position_embedding_type == "learned_absolute" else 0)
    params = v * h + pos + m.num_layers * _layer_params(cfg) + 2 * h
    tokens = length // cp
    working = tokens * WORKING_SET_PER_WIDTH * h * e // 4
    return FIXED_BYTES + params * e + max(working, tokens * LOGIT_BYTES * v)


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _address_space_left() -> int | None:
    """What ``ulimit -v`` (RLIMIT_AS) leaves a process like this one (which has imported
    what a worker imports), or None without a limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    used = 0
    try:
        with open("/proc/self/status") as f:
            used = next((int(x.split()[1]) * 1024 for x in f if x.startswith("VmSize:")), 0)
    except (OSError, ValueError, IndexError):
        pass
    return max(soft - used, 0)


def rank_capacity(ranks: int) -> tuple[int, str] | None:
    """(bytes, what they are) one of ``ranks`` ranks on this machine can use; None when
    unknown (then nothing is refused)."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return int(props.total_memory), f"{props.name}'s {props.total_memory / GIB:.1f} GiB"
    found: list[tuple[int, str]] = []
    avail = _meminfo("MemAvailable")
    if avail is not None:
        found.append((avail // ranks, f"{avail / GIB:.1f} GiB of available host memory "
                                      f"over {ranks} rank{'s' if ranks > 1 else ''}"))
    left = _address_space_left()
    if left is not None:
        found.append((left, f"{left / GIB:.1f} GiB of address space that the limit "
                            f"(ulimit -v) leaves a rank"))
    return min(found) if found else None


def check_eval_memory(cfg: Any, lengths: list[int], cp: int) -> None:
    """Refuse, in one line before any process starts, a longest length whose forward
    will not fit a rank; the line says what would (more ranks, or a shorter length)."""
    cap = rank_capacity(cp)
    if cap is None:
        return
    longest = max(lengths)
    need = eval_bytes(cfg, longest, cp)
    if need <= cap[0]:
        return
    more = next((k for k in (2, 4, 8, 16, 32, 64)
                 if longest % (2 * cp * k) == 0 and eval_bytes(cfg, longest, cp * k)
                 <= (rank_capacity(cp * k) or cap)[0]), None)  # fmt: skip
    fits = max((n for n in lengths if eval_bytes(cfg, n, cp) <= cap[0]), default=None)
    ways = [f"--nproc-per-node {cp * more} (the sequence over more ranks)"] if more else []
    if fits is not None:
        ways.append(f"lengths up to {fits:,} tokens")
    raise ConfigError(
        f"--lengths: the longest, {longest:,} tokens, needs about {need / GIB:.1f} GiB per "
        f"rank (the memory model: weights, a layer's working set, the logits of "
        f"{longest // cp:,} tokens), more than the {cap[1]}; "
        + (" or ".join(ways) if ways else "no layout of this machine fits it: shorter --lengths"))


"""The lines after ``done``: the commands that sample, export and evaluate the checkpoint
in --save, then the hint to train further (:mod:`hla_sp.launch.checkpoint.next_steps`)."""

from __future__ import annotations

import os
import shlex
from typing import Any

from hla_sp.launch.checkpoint.next_steps import train_further
from hla_sp.launch.export.generate import GenerateError, check_decodable


def next_commands(cfg: Any, iteration: int) -> list[str]:
    """The lines after ``done``: sample, export, evaluate the checkpoint in --save, and
    train further; one line saying why when nothing was saved."""
    save = cfg.checkpoint.save
    if not save:
        return ["next: nothing was saved (no --save), so there is no checkpoint to sample, "
                "export or evaluate"]
    q = shlex.quote(save)
    out = ["next:"]
    try:
        check_decodable(cfg)
        out.append(f"  hla-sp generate --load {q} --prompt 'def ' --max-new-tokens 200")
    except GenerateError:
        pass  # softmax layers or rope: generate refuses them; the export decodes
    out.append(f"  hla-sp export --load {q} --output {shlex.quote(_beside(save, 'hf'))}")
    m = cfg.model
    # learned positions reach no further than their table; the others run at any length
    length = (m.max_position_embeddings or m.seq_length
              if m.position_embedding_type == "learned_absolute" else 4 * m.seq_length)
    out.append(f"  hla-sp eval --load {q} --task ppl-by-position --lengths {length} "
               f"--output {shlex.quote(_beside(save, 'eval'))}")
    out.append(f"  {train_further(cfg, iteration)}")
    return out


def _beside(save: str, name: str) -> str:
    """``runs/demo/ckpt`` -> ``runs/demo/NAME``: an output next to the checkpoint."""
    parent = os.path.dirname(os.path.normpath(save))
    return os.path.join(parent, name) if parent else name

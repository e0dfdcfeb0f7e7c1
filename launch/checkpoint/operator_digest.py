"""The source of the operators a run registered (``--custom-import``), recorded with
each checkpoint, so that a reader notices when the operator changed after training.

A checkpoint names its operator, and the module that registers it is imported again by
every reader; if that module's maths changed meanwhile, the same weights would give
other logits without a word. ``manifest.json`` therefore records, for every operator
registered at run time, the SHA-256 of the source of the modules holding its stages,
public function and reference; a resume, ``generate``, ``eval`` and ``export`` compare
it with the source imported now and warn in one line when it differs.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from typing import Any


def digests() -> dict[str, dict[str, Any]]:
    """Operator name -> {"modules": [...], "sha256": hex} for each operator registered
    at run time (the built-in ones change with the package's version, not here)."""
    from hla_sp.config import OPERATORS, operator_names
    from hla_sp.ops import operators

    out: dict[str, dict[str, Any]] = {}
    for name in operator_names():
        spec = operators.TABLE.get(name)
        if name in OPERATORS or spec is None:
            continue
        modules = sorted({getattr(f, "__module__", None) or "?"
                          for f in (spec.stages, spec.public, spec.reference)})
        h = hashlib.sha256()
        for m in modules:
            try:
                src = inspect.getsource(sys.modules[m])
            except (KeyError, OSError, TypeError):  # no source to read (built at run time)
                src = ""
            h.update(m.encode() + b"\0" + src.encode() + b"\0")
        out[name] = {"modules": modules, "sha256": h.hexdigest()}
    return out


def changed(recorded: object) -> list[str]:
    """One line per operator whose source differs from ``recorded`` (a manifest's
    ``operators``); operators not registered now are left to the config's check."""
    if not isinstance(recorded, dict):
        return []
    now = digests()
    out = []
    for name, rec in sorted(recorded.items()):
        if not isinstance(rec, dict) or name not in now:
            continue
        if rec.get("sha256") != now[name]["sha256"]:
            out.append(f"operator {name!r} ({', '.join(now[name]['modules'])}) changed since "
                       f"the checkpoint was saved (source sha256 {str(rec.get('sha256'))[:12]} "
                       f"then, {now[name]['sha256'][:12]} now): its outputs may differ from "
                       f"the training run's")
    return out

"""The optional extras each command needs, and a one-line error when one is missing.

``pip install "hla-sp[megatron]"`` (``hla-sp train``, ``python -m
hla_sp.launch.train``, the Megatron drop-in), ``"hla-sp[ray]"`` (``hla-sp sweep``),
``"hla-sp[plot]"`` (the plots); see README.md, "Installing".
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

from hla_sp.launch.errors import ConfigError

# extra -> (module that proves it is installed, what it is)
EXTRAS: dict[str, tuple[str, str]] = {
    "megatron": ("megatron.core", "megatron-core"),
    "ray": ("ray.train", "Ray Train"),
    "plot": ("matplotlib", "matplotlib"),
}


class MissingExtra(ConfigError):
    """An optional dependency a command needs is not installed; says how to install it."""


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (a parent package may be)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent, or a module set to None
        return False


def require(extra: str, command: str) -> None:
    """Raise :class:`MissingExtra` naming ``extra`` unless its module imports."""
    module, what = EXTRAS[extra]
    if not installed(module):
        raise MissingExtra(
            f'{command} needs {what} ({module}), which is not installed: '
            f'pip install "hla-sp[{extra}]"'
        )
    if extra == "megatron":
        _megatron_version(command)


def pyplot() -> ModuleType:
    """matplotlib's ``pyplot`` on the Agg backend (files, no display), imported on first
    use: launch's one import of matplotlib (the plot extra). ImportError when missing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _megatron_version(command: str) -> None:
    """Refuse a megatron-core older than the tested ones (one line); a newer one runs
    with a warning."""
    from hla_sp.megatron_patch.compat import check_version

    try:
        check_version(command)
    except ValueError as e:
        raise ConfigError(str(e)) from None

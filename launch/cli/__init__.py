"""``hla-sp``, the console script (:mod:`.commands`): ``hla-sp train``, ``sweep``,
``make-dataset``, ``generate``, ``export``, ``eval``. ``python -m hla_sp.launch.cli`` is the
same command."""

from hla_sp.launch.cli.commands import main

__all__ = ["main"]

"""torchrun as ``hla-sp train`` runs it: ``torch.distributed.run``, with a quiet signal exit.

    python -m hla_sp.launch.torchrun <torchrun arguments> -m hla_sp.launch.train <flags>

The same arguments and behaviour as ``torchrun``, except on SIGINT/SIGTERM: torchrun's
agent passes the signal to the workers (rank 0 says, in one line, how the run stopped)
and then dies with a traceback of its own ``SignalException``. Here it leaves with
status 128 + the signal instead, and without the agent's "death signal" log lines.
"""

from __future__ import annotations

import logging
import sys

# what the agent logs on a signal; the workers' own line says it better
_QUIET = ("death signal", "Closing process", "Sending process", "Got termination signal")


class _DropSignalChatter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(q in msg for q in _QUIET)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    quiet = _DropSignalChatter()
    for handler in logging.getLogger().handlers:
        handler.addFilter(quiet)
    for name in ("torch.distributed.elastic.agent.server.api",
                 "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(quiet)
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""torchrun as ``hla-sp train`` runs it: ``torch.distributed.run``, with a quiet signal exit.

    python -m hla_sp.launch.torchrun <torchrun arguments> -m hla_sp.launch.train <flags>

The same arguments and behaviour as ``torchrun``, except:

* on SIGINT/SIGTERM: torchrun's agent passes the signal to the workers (rank 0 says, in
  one line, how the run stopped) and then dies with a traceback of its own
  ``SignalException``. Here it leaves with status 128 + the signal instead, and without
  the agent's "death signal" log lines.
* on an error of a known kind in the workers (a flag, a checkpoint, a data file): the
  workers write it to a report directory instead of printing it, and this process
  prints it once, in one line (however many ranks raised it), and leaves with the
  workers' status, without torchrun's ``ChildFailedError`` summary.
* on any other error in the workers: they write their traceback and diagnosis there
  too, and this process prints the first failing rank's traceback once, then one
  summary line (the ranks that failed after it folded in). A worker killed before it
  could report (SIGKILL) leaves only torchrun's summary, which is kept then.
  ``HLA_SP_DEBUG=1`` keeps everything as torchrun has it, every worker's traceback
  included.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator

from hla_sp.launch import errors
from hla_sp.launch.errors import KNOWN_EXIT, read_failures, read_reports

# what the agent logs on a signal; the workers' own line says it better
_QUIET = ("death signal", "Closing process", "Sending process", "Got termination signal")


class _DropSignalChatter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(q in msg for q in _QUIET)


class _DropFailedLine(logging.Filter):
    """The agent's "failed (exitcode ...)" line, dropped once a worker has reported a
    known error (the launcher prints that error instead)."""

    def __init__(self, reports: str):
        super().__init__()
        self.reports = reports

    def filter(self, record: logging.LogRecord) -> bool:
        return not ("failed (exitcode" in record.getMessage()
                    and (read_reports(self.reports) or read_failures(self.reports)))


@contextlib.contextmanager
def _restore_env(name: str, value: str | None) -> Iterator[None]:
    """Put ``name`` back as it was (an in-process caller keeps no stale report dir)."""
    try:
        yield
    finally:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def known_failure(failures: dict[int, object], reports: list[dict]) -> int:
    """The exit status for a run that stopped on the reported errors: a reporting
    worker's own status (the first failure's rank first), else the known errors' one."""
    ranks = {int(r.get("rank", -1)) for r in reports}
    codes = [getattr(f, "exitcode", 0) for r, f in sorted(failures.items()) if r in ranks]
    return next((c for c in codes if isinstance(c, int) and c > 0), KNOWN_EXIT)


def main(argv: list[str] | None = None, prog: str = "hla-sp train") -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    quiet = _DropSignalChatter()
    for handler in logging.getLogger().handlers:
        handler.addFilter(quiet)
    for name in ("torch.distributed.elastic.agent.server.api",
                 "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(quiet)
    before = os.environ.get(errors.REPORT_ENV)
    with tempfile.TemporaryDirectory(prefix="hla-sp-errors-") as reports, \
            _restore_env(errors.REPORT_ENV, before):
        if not errors.debug():  # under HLA_SP_DEBUG the workers print for themselves
            os.environ[errors.REPORT_ENV] = reports  # the workers inherit it
            logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
                _DropFailedLine(reports))
        try:
            torchrun_main(sys.argv[1:] if argv is None else argv)
        except SignalException as e:
            return 128 + int(e.sigval)
        except ChildFailedError as e:
            if errors.debug():
                raise
            found = errors.read_reports(reports)
            if found:
                for line in errors.summarize_reports(found):
                    print(f"{prog}: error: {line}", file=sys.stderr, flush=True)
                return known_failure(e.failures, found)
            failures = errors.read_failures(reports)
            if not failures:
                raise
            text, line = errors.summarize_failures(failures, prog)
            sys.stderr.write(text)
            print(line, file=sys.stderr, flush=True)
            status = getattr(e.failures.get(failures[0].rank), "exitcode", 1)
            return status if isinstance(status, int) and status > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

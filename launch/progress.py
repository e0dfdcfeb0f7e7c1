"""Progress of a long command, with an ETA: a bar on a terminal, periodic lines in a log.

One :class:`Progress` per piece of work whose size is known up front (tokens to
evaluate, bytes to tokenize, trials to run, tokens to generate, stages to export).
On a terminal (the stream is a TTY) it redraws one line in place, at most ten times a
second, and ends it with a new line when closed; elsewhere (torchrun's or Ray's pipes,
a file) it writes a line every ``HLA_SP_PROGRESS_SECONDS`` seconds (default 30), the
first after that long, so a short command stays quiet. The ETA assumes the rest goes
at the rate so far, per unit of ``total``: give units whose cost is even (tokens, not
windows of different lengths).

    with Progress("eval", total=tokens, unit="tokens") as bar:
        for ...:
            bar.advance(n)           # n more units done
            bar.say("a result line")  # printed above the bar
"""

from __future__ import annotations

import os
import sys
import time
from types import TracebackType
from typing import TextIO

INTERVAL_ENV = "HLA_SP_PROGRESS_SECONDS"
_REDRAW_S = 0.1  # a terminal's bar: at most this often
_WIDTH = 24  # the bar's cells


def count(n: float) -> str:
    """1234 -> 1.23k, 4.5e6 -> 4.50M (tokens on the progress line)."""
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def duration(seconds: float) -> str:
    """Seconds as 42s, 3m05s or 2h07m."""
    s = max(round(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _count(n: float, unit: str) -> str:
    return f"{count(n)} {unit}".rstrip() if n >= 1000 else f"{n:g} {unit}".rstrip()


class Progress:
    """Done / ``total`` units of one piece of work, shown on ``stream`` (default stderr)
    while ``enabled`` (False: a no-op, e.g. on every rank but the first)."""

    def __init__(self, label: str, total: float, unit: str = "", *,
                 stream: TextIO | None = None, enabled: bool = True,
                 interval_s: float | None = None) -> None:
        self.label, self.total, self.unit = label, max(float(total), 0.0), unit
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled and self.total > 0
        self.tty = self.enabled and self.stream.isatty()
        if interval_s is None:
            interval_s = float(os.environ.get(INTERVAL_ENV, "30"))
        self.interval_s = interval_s
        self.done = 0.0
        self.note = ""
        self.start = self._last = time.monotonic()
        self._drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def text(self) -> str:
        """``label: 45% (12.3k/27.4k tokens), elapsed 42s, ETA 51s[, note]``."""
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        elapsed = time.monotonic() - self.start
        eta = (f"ETA {duration(elapsed / self.done * (self.total - self.done))}"
               if self.done > 0 else "ETA unknown")
        return (f"{self.label}: {100 * frac:.0f}% ({_count(self.done, '')}/"
                f"{_count(self.total, self.unit)}), elapsed {duration(elapsed)}, {eta}"
                + (f", {self.note}" if self.note else ""))

    def advance(self, n: float = 1, note: str | None = None) -> None:
        """``n`` more units done (``note``: what is running now, shown after the ETA)."""
        if not self.enabled:
            return
        self.done += n
        if note is not None:
            self.note = note
        now = time.monotonic()
        if self.tty:
            if now - self._last >= _REDRAW_S or self.done >= self.total:
                self._draw()
                self._last = now
        elif now - self._last >= self.interval_s and self.done < self.total:
            self.stream.write(self.text() + "\n")
            self.stream.flush()
            self._last = now

    def _draw(self) -> None:
        cells = int(_WIDTH * min(self.done / self.total, 1.0))
        bar = "#" * cells + "." * (_WIDTH - cells)
        self.stream.write(f"\r\033[K[{bar}] {self.text()}")
        self.stream.flush()
        self._drawn = True

    def clear(self) -> None:
        """Take the bar off the terminal's line (before other output)."""
        if self.tty and self._drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._drawn = False

    def say(self, line: str, stream: TextIO | None = None) -> None:
        """Print ``line`` (default: stdout) above the bar, which is drawn again."""
        self.clear()
        print(line, file=sys.stdout if stream is None else stream, flush=True)
        if self.tty and self.done > 0:
            self._draw()

    def close(self) -> None:
        """The bar's last state stays on its own line; a log gets nothing more."""
        if self.tty and self._drawn:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
        self.enabled = self.tty = False

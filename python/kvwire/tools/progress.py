"""Progress lines for long ``kvwire`` commands (fidelity, and any other long loop).

Progress goes to stderr, and only when stderr is a terminal and ``--quiet`` was not
given, so that it never mixes into stdout (a table, ``--json``) nor into a log file or a
CI transcript, where a line rewritten with carriage returns is noise.
"""

from __future__ import annotations

import sys
import time


class Progress:
    """``step(label)`` before each of ``total`` items; ``done()`` at the end clears the line."""

    def __init__(self, total: int, what: str, *, quiet: bool = False, stream=None):
        self.total, self.what, self.n = total, what, 0
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = not quiet and bool(isatty and isatty())
        self.t0 = time.monotonic()

    def step(self, label: str) -> None:
        self.n += 1
        if self.enabled:
            elapsed = time.monotonic() - self.t0
            self.stream.write(f"\r\x1b[K{self.what} {self.n}/{self.total}: {label} ({elapsed:.0f}s)")
            self.stream.flush()

    def done(self) -> None:
        if self.enabled:
            self.stream.write(f"\r\x1b[K{self.what}: {self.total} done in {time.monotonic() - self.t0:.1f}s\n")
            self.stream.flush()

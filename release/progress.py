"""Progress on stderr, only when it is a terminal and not silenced with ``--quiet``."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Step messages and a throttled percentage line; a no-op when disabled."""

    def __init__(self, stream: TextIO | None = None, *, quiet: bool = False) -> None:
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", lambda: False)
        self.enabled = not quiet and bool(isatty())
        self._last = 0.0
        self._open_line = False

    def step(self, message: str) -> None:
        if not self.enabled:
            return
        self._end_line()
        self.stream.write(f"... {message}\n")
        self.stream.flush()

    def bytes(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        pct = 100.0 * done / max(total, 1)
        self.stream.write(f"\r    {pct:5.1f}% of {total / 2**20:.1f} MiB")
        self._open_line = True
        if done >= total:
            self._end_line()
        self.stream.flush()

    def _end_line(self) -> None:
        if self._open_line:
            self.stream.write("\n")
            self._open_line = False

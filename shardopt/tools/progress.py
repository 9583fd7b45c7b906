"""A one-line progress bar for the command line (no dependency)."""
from __future__ import annotations

import sys


class ProgressBar:
    """`update(done, text)` redraws one line on a terminal; elsewhere (logs, CI) prints about 5 lines."""

    def __init__(self, total: int, label: str = "", width: int = 24, stream=None, enabled: bool = True):
        self.total, self.label, self.width = max(1, total), label, width
        self.stream = stream or sys.stdout
        self.enabled = enabled
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._printed = -1

    def line(self, done: int, text: str = "") -> str:
        filled = done * self.width // self.total
        return f"{self.label:>8} [{'#' * filled}{'.' * (self.width - filled)}] {done:>4}/{self.total} {text}"

    def update(self, done: int, text: str = "") -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + self.line(done, text) + ("\n" if done >= self.total else ""))
            self.stream.flush()
            return
        # Not a terminal: a line at each fifth of the way, and the last.
        stride = max(1, self.total // 5)
        if done >= self.total or done // stride != self._printed // stride or self._printed < 0:
            self._printed = done
            print(self.line(done, text), file=self.stream, flush=True)

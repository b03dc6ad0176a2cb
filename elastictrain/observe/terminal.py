"""The one status line at the bottom of rank 0's terminal, and whether to draw it.

Owned here, below both the logging handler (which prints records above the line) and the progress
display (which redraws it), so neither depends on the other.
"""

from __future__ import annotations

import os
import shutil
import threading
from typing import IO


class StatusLine:
    """The one line at the bottom of a terminal that is rewritten in place."""

    def __init__(self) -> None:
        self.stream: IO[str] | None = None
        self._text = ""
        self._lock = threading.Lock()  # the persist thread logs too

    def attach(self, stream: IO[str]) -> None:
        self.stream = stream

    def show(self, text: str) -> None:
        if self.stream is None:
            return
        width = max(shutil.get_terminal_size((120, 20)).columns - 1, 20)
        with self._lock:
            self._text = text[:width]
            self.stream.write("\r\x1b[K" + self._text)
            self.stream.flush()

    def around_log(self, write) -> None:
        """Print a log record above the status line (called by the logging handler)."""
        if self.stream is None or not self._text:
            write()
            return
        with self._lock:
            self.stream.write("\r\x1b[K")
            write()
            self.stream.write(self._text)
            self.stream.flush()

    def close(self) -> None:
        """Leave the last status on screen and move below it."""
        with self._lock:
            if self.stream is not None and self._text:
                self.stream.write("\n")
                self.stream.flush()
            self.stream, self._text = None, ""


STATUS = StatusLine()


def live_terminal(mode: str, stream: IO[str]) -> bool:
    """``--progress``: ``auto`` is live on an interactive terminal, plain lines otherwise."""
    if mode != "auto":
        return mode == "live"
    is_tty = getattr(stream, "isatty", lambda: False)()
    return bool(is_tty) and os.environ.get("TERM", "") != "dumb"

"""Logging with a ``[rank r | step s]`` prefix, printed above rank 0's live status line."""

from __future__ import annotations

import logging
import sys

from elastictrain import knobs
from elastictrain.observe.terminal import STATUS


class _Context:
    rank: int | str = "-"
    step: int | str = "-"


CONTEXT = _Context()


class _PrefixFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = CONTEXT.rank
        record.step = CONTEXT.step
        return True


class _Handler(logging.StreamHandler):
    """Prints records above rank 0's live status line, when there is one."""

    def emit(self, record: logging.LogRecord) -> None:
        STATUS.around_log(lambda: super(_Handler, self).emit(record))


def setup_logging(rank: int, level: str | None = None) -> None:
    """Idempotent. Rank 0 logs at INFO; the others only warnings and errors, so N ranks do not
    print N copies of the same story. ELASTICTRAIN_LOG_LEVEL overrides the level on every rank."""
    CONTEXT.rank = rank
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_elastictrain", False):
            root.removeHandler(h)
    handler = _Handler(sys.stderr)
    handler._elastictrain = True  # type: ignore[attr-defined]
    handler.addFilter(_PrefixFilter())
    handler.setFormatter(
        logging.Formatter(
            "%(asctime)s %(levelname)s [rank %(rank)s | step %(step)s] %(message)s", "%H:%M:%S"
        )
    )
    root.addHandler(handler)
    default = "INFO" if rank in (0, "-") else "WARNING"
    root.setLevel(level or knobs.log_level(default))

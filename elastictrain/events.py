"""Logging with a ``[rank r | step s]`` prefix, and rank 0's JSONL event log."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

import torch

logger = logging.getLogger(__name__)


class _Context:
    rank: int | str = "-"
    step: int | str = "-"


CONTEXT = _Context()


class _PrefixFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = CONTEXT.rank
        record.step = CONTEXT.step
        return True


def setup_logging(rank: int, level: str | None = None) -> None:
    """Idempotent; ELASTICTRAIN_LOG_LEVEL overrides the level."""
    CONTEXT.rank = rank
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_elastictrain", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler._elastictrain = True  # type: ignore[attr-defined]
    handler.addFilter(_PrefixFilter())
    handler.setFormatter(
        logging.Formatter(
            "%(asctime)s %(levelname)s [rank %(rank)s | step %(step)s] %(message)s", "%H:%M:%S"
        )
    )
    root.addHandler(handler)
    root.setLevel(level or os.environ.get("ELASTICTRAIN_LOG_LEVEL", "INFO"))


class EventLog:
    """Appends one JSON object per line; opened in append mode so restarts extend the same story.

    Each write is a single ``write`` of one line on an O_APPEND file, flushed at once, so a kill
    can lose at most the line being written and never interleaves two lines.
    """

    def __init__(self, path: str | None, *, enabled: bool) -> None:
        self.path = path if enabled else None
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._terminate_torn_line()

    def _terminate_torn_line(self) -> None:
        """A kill mid-write leaves a line without its newline; end it so the next one survives."""
        try:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        except OSError:  # missing or empty file
            return
        if torn:
            with open(self.path, "ab") as f:
                f.write(b"\n")

    def emit(self, event: str, **fields: Any) -> None:
        if not self.path:
            return
        try:
            _append_line(self.path, {"event": event, "time": time.time(), **fields})
        except OSError as e:
            # An unwritable event log must not kill training; say so once per failure.
            logger.warning("could not append to event log %s: %s", self.path, e)


def _append_line(path: str, record: dict[str, Any]) -> None:
    """One ``write`` of one line on an O_APPEND file: a kill loses at most that line."""
    line = json.dumps(record, sort_keys=True, default=str) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class SampleLog:
    """Every rank's ledger of the dataset indices it trained on, one file per (generation, rank).

    Lines: ``step, epoch, rank, world_size, generation, indices``. For each step the entries of the
    highest generation are the ones in the committed history.
    """

    def __init__(
        self, directory: str | None, *, rank: int, world_size: int, generation: int
    ) -> None:
        self.path = None
        if directory:
            os.makedirs(directory, exist_ok=True)
            self.path = os.path.join(directory, f"samples-g{generation}-r{rank}.jsonl")
        self.rank, self.world_size, self.generation = rank, world_size, generation

    def record(self, step: int, share: Any) -> None:
        if self.path:
            _append_line(
                self.path,
                {
                    "step": step,
                    "epoch": share.epoch,
                    "rank": self.rank,
                    "world_size": self.world_size,
                    "generation": self.generation,
                    "indices": share.indices.tolist(),
                },
            )


def read_sample_log(directory: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("samples-") and name.endswith(".jsonl"):
            out += read_events(os.path.join(directory, name))
    return out


def read_events(path: str) -> list[dict[str, Any]]:
    """Parse an event log, skipping a torn last line left by a kill."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


class Progress:
    """Rank 0's periodic progress line and event."""

    def __init__(
        self,
        *,
        world_size: int,
        start_step: int,
        max_steps: int,
        every_s: float,
        events: EventLog,
        enabled: bool,
    ):
        self.world_size = world_size
        self.max_steps = max_steps
        self.every_s = every_s
        self.events = events
        self.enabled = enabled
        self._last_t = time.monotonic()
        self._last_step = start_step
        self.last_checkpoint: int | None = None

    def due(self) -> bool:
        """Rank 0's clock says a report is due; the loop makes it everyone's decision."""
        return self.enabled and time.monotonic() - self._last_t >= self.every_s

    def report(self, step: int, loss: torch.Tensor, stragglers: Any = None) -> None:
        """Log and record progress (rank 0 only); ``stragglers`` is a StragglerReport or None."""
        if not self.enabled:
            return
        now = time.monotonic()
        rate = (step - self._last_step) / max(now - self._last_t, 1e-9)
        eta = (self.max_steps - step) / rate if rate > 0 else float("inf")
        value = float(loss.item())
        logger.info(
            "progress %d/%d loss %.5f %.1f steps/s eta %s last checkpoint %s world size %d",
            step,
            self.max_steps,
            value,
            rate,
            _fmt_eta(eta),
            self.last_checkpoint,
            self.world_size,
        )
        self.events.emit(
            "progress",
            step=step,
            loss=value,
            steps_per_s=round(rate, 3),
            world_size=self.world_size,
        )
        if stragglers is not None and self.world_size > 1:
            logger.info("%s", stragglers.describe())
            self.events.emit("stragglers", step=step, **stragglers.as_event())
        self._last_t, self._last_step = now, step


def _fmt_eta(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"

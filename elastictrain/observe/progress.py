"""Rank 0's progress: a live status line on a terminal, periodic plain lines in logs.

On a TTY the status line is redrawn in place (at most ``_REDRAW_S`` apart, from the loop, with no
collective) and log records are printed above it: the logging handler clears the line, prints the
record and redraws it. Everywhere else (a log file, a pipe, ``--progress plain``) rank 0 writes one
``progress`` line every ``--log-every-seconds``. Either way a ``progress`` event is recorded.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any

import torch

from elastictrain.observe.events import Event
from elastictrain.observe.stragglers import Straggler, StragglerWatch
from elastictrain.observe.terminal import STATUS

if TYPE_CHECKING:
    from elastictrain.observe.events import EventLog

logger = logging.getLogger(__name__)

_REDRAW_S = 0.25  # the live line is redrawn at most this often


class Progress:
    """Rank 0's progress display and ``progress`` events; a no-op elsewhere."""

    def __init__(
        self,
        *,
        world_size: int,
        start_step: int,
        max_steps: int,
        every_s: float,
        events: EventLog,
        enabled: bool,
        restarts: int = 0,
        hosts: list[str] | None = None,
        live: bool = False,
        stream: IO[str] | None = None,
        clock=time.monotonic,
    ):
        self.world_size = world_size
        self.max_steps = max_steps
        self.every_s = every_s
        self.events = events
        self.enabled = enabled
        self.restarts = restarts
        self.stragglers = StragglerWatch(hosts)
        self._clock = clock
        self._last_t = clock()
        self._last_step = start_step
        self.last_checkpoint: int | None = None
        self.last_local: int | None = None  # the newest local-tier copy, when there is one
        self.live = enabled and live
        if self.live:
            STATUS.attach(stream or sys.stderr)
        self._drawn_t, self._drawn_step, self._rate = self._last_t, start_step, 0.0
        self._shown: tuple[int, float] | None = None

    def rolled_back(self, step: int) -> None:
        """Training goes on from an earlier ``step`` (``train.numerics``): rates count from it."""
        self._last_step = self._drawn_step = step

    def due(self) -> bool:
        """Rank 0's clock says a report is due; the loop makes it everyone's decision."""
        return self.enabled and self._clock() - self._last_t >= self.every_s

    def tick(self, step: int, loss: torch.Tensor) -> None:
        """Every step on every rank; redraws the live line now and then (rank 0, TTY only)."""
        if not self.live:
            return
        now = self._clock()
        if now - self._drawn_t < _REDRAW_S and step < self.max_steps:
            return
        rate = (step - self._drawn_step) / max(now - self._drawn_t, 1e-9)
        self._rate = rate if self._rate == 0 else 0.7 * self._rate + 0.3 * rate  # smooth the ETA
        self._drawn_t, self._drawn_step = now, step
        self._shown = (step, float(loss.item()))
        STATUS.show(self.status_text(*self._shown, self._rate))

    def status_text(self, step: int, loss: float, rate: float) -> str:
        frac = min(step / self.max_steps, 1.0) if self.max_steps else 1.0
        bar = "#" * int(10 * frac) + "." * (10 - int(10 * frac))
        eta = (self.max_steps - step) / rate if rate > 0 else float("inf")
        return (
            f"step {step}/{self.max_steps} [{bar}] {100 * frac:5.1f}% | loss {loss:.5f} | "
            f"{rate:.1f} steps/s | ETA {fmt_eta(eta)} | ckpt {self.last_checkpoint}"
            f"{f' (local {self.last_local})' if self._local_is_newer() else ''} | "
            f"world {self.world_size} | restarts {self.restarts}"
        )

    def report(
        self,
        step: int,
        loss: torch.Tensor | float,
        stragglers: Any = None,
        *,
        metrics: Mapping[str, float] | None = None,
        **fields: Any,
    ) -> list[Straggler]:
        """Log and record progress (rank 0 only); ``stragglers`` is a StragglerReport or None,
        ``metrics`` the task's own (means since the last report), ``fields`` more event fields
        (grad norm, overflow skips). Returns the ranks newly named stragglers or recovered."""
        if not self.enabled:
            return []
        now = self._clock()
        rate = (step - self._last_step) / max(now - self._last_t, 1e-9)
        eta = (self.max_steps - step) / rate if rate > 0 else float("inf")
        value = float(loss)
        metrics = dict(metrics or {})
        if not self.live:  # on a terminal the status line already says all of this
            logger.info(
                "progress %d/%d loss %.5f%s %.1f steps/s eta %s last checkpoint %s world size %d%s",
                step,
                self.max_steps,
                value,
                "".join(f" {k} {v:.5g}" for k, v in {**metrics, **fields}.items()),
                rate,
                fmt_eta(eta),
                self.last_checkpoint,
                self.world_size,
                f" local copy {self.last_local}" if self._local_is_newer() else "",
            )
        self.events.emit(
            Event.PROGRESS,
            step=step,
            loss=value,
            steps_per_s=round(rate, 3),
            world_size=self.world_size,
            **({"metrics": metrics} if metrics else {}),
            **fields,
        )
        changes = []
        if stragglers is not None and self.world_size > 1:
            logger.info("%s", stragglers.describe())
            self.events.emit(Event.STRAGGLERS, step=step, **stragglers.as_event())
            changes = self.stragglers.update(stragglers)
            for change in changes:
                logger.warning("%s", change.describe())
                self.events.emit(Event.STRAGGLER, step=step, **change.as_event())
        self._last_t, self._last_step = now, step
        return changes

    def _local_is_newer(self) -> bool:
        """A local copy is worth showing only while it is newer than the durable checkpoint."""
        return self.last_local is not None and (self.last_checkpoint or -1) < self.last_local

    def close(self) -> None:
        """Draw the status once more (the final checkpoint has landed since) and leave it."""
        if self.live:
            if self._shown is not None:
                STATUS.show(self.status_text(*self._shown, self._rate))
            STATUS.close()


def fmt_eta(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"

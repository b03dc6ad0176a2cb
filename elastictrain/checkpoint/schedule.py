"""When to checkpoint: every N steps and/or every T seconds."""

from __future__ import annotations

import time
from collections.abc import Callable


class CheckpointSchedule:
    """Every N steps and/or every T seconds. Only rank 0's clock counts, so ranks cannot disagree."""

    def __init__(
        self,
        every_steps: int | None,
        every_seconds: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self._clock = clock
        self._last = clock()

    @property
    def uses_time(self) -> bool:
        return self.every_seconds is not None

    def due_by_steps(self, completed_steps: int) -> bool:
        return bool(self.every_steps) and completed_steps % self.every_steps == 0

    def due_by_time(self) -> bool:
        """Rank 0's opinion; the loop makes it everyone's with one collective."""
        return self.uses_time and self._clock() - self._last >= self.every_seconds

    def mark_saved(self) -> None:
        self._last = self._clock()

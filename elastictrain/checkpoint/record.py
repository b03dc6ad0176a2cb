"""What one tier's saves came to on one rank: :class:`SaveRecord`."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from elastictrain.checkpoint.api import Reason


@dataclass(frozen=True)
class Failure:
    step: int
    reason: Reason
    error: BaseException


class SaveRecord:
    """The one owner of one tier's save state on one rank: what is committed, what was skipped,
    what failed. Written only through its methods, under a lock: the training thread records a
    resume and a foreground commit, the persister's background thread its commits and failures.
    Read without one (each field is one reference: a reader sees the old value or the new)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_committed: int | None = None
        self._skipped = 0
        self._skipped_step: int | None = None
        self._failure: Failure | None = None

    @property
    def last_committed(self) -> int | None:
        """The newest durable step resumed from or committed (rank 0: including background
        commits)."""
        return self._last_committed

    @property
    def skipped(self) -> int:
        """Checkpoints skipped so far (storage refused them under ``warn``)."""
        return self._skipped

    @property
    def skipped_step(self) -> int | None:
        """The newest step this rank gave up writing in the background (the loop tells the
        others)."""
        return self._skipped_step

    @property
    def failure(self) -> Failure | None:
        """A background persist that failed for good: the loop stops every rank on it (durable),
        or the tier turns itself off (local)."""
        return self._failure

    def committed(self, step: int | None) -> None:
        """``step`` is the newest committed one (None: a new attempt that has committed none)."""
        with self._lock:
            self._last_committed = step

    def skip(self) -> int:
        """One more checkpoint skipped; returns how many so far."""
        with self._lock:
            self._skipped += 1
            return self._skipped

    def gave_up(self, step: int) -> None:
        """This rank stopped writing ``step`` in the background."""
        with self._lock:
            self._skipped_step = step

    def failed(self, failure: Failure) -> None:
        with self._lock:
            self._failure = failure

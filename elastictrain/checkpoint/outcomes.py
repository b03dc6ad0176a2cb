"""What a save can come to, who records it, and what a failure does.

- :class:`SaveOutcome`: committed, skipped or failed, agreed over the ranks.
- :class:`SaveRecord`: the one owner of a tier's save state on one rank.
- :class:`FailurePolicy`: what a failed save does to the run. The durable tier stops it
  (:class:`StopTheRun`, except what ``on_storage_failure="warn"`` lets it skip); the local tier
  turns itself off (:class:`TurnTierOff`).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Protocol

import storage
from elastictrain.config import CheckpointConfig
from elastictrain.observe.events import Event, EventLog, Name

logger = logging.getLogger(__name__)


class SaveOutcome(enum.IntEnum):
    """What became of one save, broadcast from rank 0 so every rank acts on the same one. Ordered
    from best to worst: the max over ranks is the outcome of a step every rank wrote."""

    COMMITTED = 0
    SKIPPED = 1
    FAILED = 2


class Reason(Name):
    """Why a checkpoint was taken (the ``reason`` of checkpoint events)."""

    STEPS = "steps"  # every N steps
    TIME = "time"  # every T seconds, on rank 0's clock
    FINAL = "final"  # the end of training
    PREEMPT = "preempt"  # a stop signal (SIGTERM, Ctrl-C, ...)


# Checkpoints the run cannot go on without: the end of training, and the one a preemption waits for.
MUST_COMMIT = (Reason.FINAL, Reason.PREEMPT)


@dataclass(frozen=True)
class Failure:
    step: int
    reason: str
    error: BaseException


@dataclass
class SaveRecord:
    """The one owner of one tier's save state on one rank: what is committed, what was skipped,
    what failed. The writer records into it; everyone else asks it."""

    last_committed: int | None = None
    """The newest step resumed from or committed (rank 0: including background commits)."""
    skipped: int = 0
    """Checkpoints skipped so far (storage refused them under ``warn``)."""
    skipped_step: int | None = None
    """The newest step this rank gave up writing in the background (the loop tells the others)."""
    failure: Failure | None = None
    """A background persist that failed for good: the loop stops every rank on it (durable), or
    the tier turns itself off (local)."""


class FailurePolicy(Protocol):
    """What a failed save does, and how a tier reports its commits."""

    label: str
    """How logs name the tier's checkpoints ("checkpoint", "local checkpoint")."""
    commit_event: Event
    commit_level: int

    def failed(
        self, step: int, reason: str, error: BaseException, record: SaveRecord
    ) -> SaveOutcome: ...


@dataclass(frozen=True)
class StopTheRun:
    """The durable tier: a checkpoint that cannot be committed stops every rank, except a
    scheduled one storage refused under ``on_storage_failure="warn"``, which is skipped. Never
    silent."""

    config: CheckpointConfig
    events: EventLog
    label = "checkpoint"
    commit_event = Event.CHECKPOINT
    commit_level = logging.INFO

    def failed(
        self, step: int, reason: str, error: BaseException, record: SaveRecord
    ) -> SaveOutcome:
        described = f"{type(error).__name__}: {error}"
        skippable = (
            isinstance(error, storage.StorageUnavailableError)
            and self.config.on_storage_failure == "warn"
            and reason not in MUST_COMMIT
        )
        if skippable:
            record.skipped += 1
            logger.error(
                "CHECKPOINT SKIPPED at step %d (%s): %s. Training continues "
                "(--on-storage-failure warn); %d skipped so far, last committed step %s.",
                step,
                reason,
                error,
                record.skipped,
                record.last_committed,
            )
            self.events.emit(
                Event.CHECKPOINT_SKIPPED,
                step=step,
                reason=reason,
                error=described,
                skipped_total=record.skipped,
                last_committed=record.last_committed,
            )
            return SaveOutcome.SKIPPED
        # A bug in the background (not storage) gets its traceback: nothing else would show it.
        trace = not isinstance(error, storage.StorageError)
        logger.error(
            "CHECKPOINT FAILED at step %d (%s): %s",
            step,
            reason,
            error,
            exc_info=error if trace else None,
        )
        self.events.emit(Event.CHECKPOINT_FAILED, step=step, reason=reason, error=described)
        return SaveOutcome.FAILED


@dataclass(frozen=True)
class TurnTierOff:
    """The local tier: a failure never stops the run. It is recorded, and the tier turns itself
    off at its next copy, saying why; the durable tier carries on."""

    label = "local checkpoint"
    commit_event = Event.LOCAL_CHECKPOINT
    commit_level = logging.DEBUG  # copies come every few steps: events only, no INFO lines

    def failed(
        self, step: int, reason: str, error: BaseException, record: SaveRecord
    ) -> SaveOutcome:
        record.failure = Failure(step, reason, error)
        if isinstance(error, storage.StorageError):
            record.skipped += 1
            return SaveOutcome.SKIPPED
        return SaveOutcome.FAILED

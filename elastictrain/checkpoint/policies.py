"""What a failed save does to the run, and how a tier reports its commits.

The durable tier stops it (:class:`StopTheRun`, except what ``on_storage_failure="warn"`` lets it
skip); the local tier turns itself off (:class:`TurnTierOff`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import storage
from elastictrain.checkpoint.api import MUST_COMMIT, Reason, SaveOutcome
from elastictrain.checkpoint.record import Failure, SaveRecord
from elastictrain.config import CheckpointConfig
from elastictrain.observe.events import Event, EventLog

logger = logging.getLogger(__name__)


class FailurePolicy(Protocol):
    """What a failed save does, and how a tier reports its commits."""

    label: str
    """How logs name the tier's checkpoints ("checkpoint", "local checkpoint")."""
    commit_event: Event
    commit_level: int

    def failed(
        self, step: int, reason: Reason, error: BaseException, record: SaveRecord
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
        self, step: int, reason: Reason, error: BaseException, record: SaveRecord
    ) -> SaveOutcome:
        described = f"{type(error).__name__}: {error}"
        skippable = (
            isinstance(error, storage.StorageUnavailableError)
            and self.config.on_storage_failure == "warn"
            and reason not in MUST_COMMIT
        )
        if skippable:
            skipped = record.skip()
            logger.error(
                "CHECKPOINT SKIPPED at step %d (%s): %s. Training continues "
                "(--on-storage-failure warn); %d skipped so far, last committed step %s.",
                step,
                reason,
                error,
                skipped,
                record.last_committed,
            )
            self.events.emit(
                Event.CHECKPOINT_SKIPPED,
                step=step,
                reason=reason,
                error=described,
                skipped_total=skipped,
                last_committed=record.last_committed,
            )
            return SaveOutcome.SKIPPED
        # A bug in the background (not storage) gets its traceback: nothing else would show it.
        trace = not isinstance(error, storage.StorageError) and getattr(
            error, "traceback_helps", True
        )
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
        self, step: int, reason: Reason, error: BaseException, record: SaveRecord
    ) -> SaveOutcome:
        record.failed(Failure(step, reason, error))
        if isinstance(error, storage.StorageError):
            record.skip()
            return SaveOutcome.SKIPPED
        return SaveOutcome.FAILED

"""Rank 0's writer: snapshot the state into reused host memory, then persist it, in the background.

The training loop is blocked only for the snapshot (a copy into warm buffers). Serialising is
already done by then: the staging buffer *is* the file. Hashing, writing, the manifest and
retention run on one background thread.

At most one persist is in flight, because there is one staging buffer (memory stays bounded by
one copy of the state). When the next checkpoint comes due while the previous one is still being
written, it *waits* for it, with a warning naming the wait, rather than skipping: a skipped
checkpoint silently widens the window of lost work, while a wait only shows that the interval is
shorter than storage can sustain, which the warning says how to fix.

Every outcome is reported: committed (log + ``checkpoint`` event), skipped under
``--on-storage-failure warn`` (``CHECKPOINT SKIPPED`` + ``checkpoint_skipped``), or failed
(``CHECKPOINT FAILED`` + ``checkpoint_failed``; the runner then stops every rank).
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import storage
from elastictrain.checkpoint import state as tstate
from elastictrain.checkpoint.staging import Snapshot, Staging
from elastictrain.errors import OrphanedError
from elastictrain.observe.events import Event, EventLog, Name
from elastictrain.version import __version__

logger = logging.getLogger(__name__)

# Outcomes of a save, broadcast from rank 0 so every rank acts on the same one.
COMMITTED, SKIPPED, FAILED = 0, 1, 2


class Reason(Name):
    """Why a checkpoint was taken (the ``reason`` of checkpoint events)."""

    STEPS = "steps"  # every N steps
    TIME = "time"  # every T seconds, on rank 0's clock
    FINAL = "final"  # the end of training
    PREEMPT = "preempt"  # a stop signal (SIGTERM, Ctrl-C, ...)


# Checkpoints the run cannot go on without: the end of training, and the one a preemption waits for.
MUST_COMMIT = (Reason.FINAL, Reason.PREEMPT)


@dataclass(frozen=True)
class _Job:
    """One checkpoint on its way to storage."""

    step: int
    epoch: int
    reason: str
    snap: Snapshot
    blocked: float
    """What the loop has waited so far: the wait for the previous persist, plus the snapshot."""
    waited: float
    background: bool


@dataclass(frozen=True)
class Failure:
    step: int
    reason: str
    error: BaseException


class Persister:
    """Rank 0 only. ``save`` blocks for the snapshot; ``background=False`` also waits for the
    commit and returns the outcome."""

    def __init__(
        self,
        *,
        store: storage.CheckpointStore,
        world_size: int,
        generation: Callable[[], int],
        events: EventLog,
        keep_last: int,
        keep_every: int | None,
        on_failure: str,
        attached: Callable[[], bool],
    ) -> None:
        self.store = store
        self.world_size = world_size
        self.generation = generation
        self.events = events
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.on_failure = on_failure
        self.attached = attached
        self.staging = Staging()
        self.skipped = 0
        self.last_committed: int | None = None
        self.failure: Failure | None = None
        """Set by a background persist that failed for good; the loop stops every rank on it."""
        self._thread: threading.Thread | None = None
        self._in_flight: int | None = None

    def wait(self) -> float:
        """Wait for the persist in flight, if any; returns the seconds waited."""
        if self._thread is None:
            return 0.0
        t0 = time.monotonic()
        self._thread.join()
        self._thread, self._in_flight = None, None
        return time.monotonic() - t0

    def save(
        self, step: int, epoch: int, reason: str, state: Callable[[], Any], *, background: bool
    ) -> tuple[int, BaseException | None]:
        """Snapshot ``state()`` now; persist it in the background or before returning."""
        previous = self._in_flight
        waited = self.wait()
        if waited > 0.05:
            logger.warning(
                "checkpoint at step %d waited %.2fs for the previous one (step %s) to persist: "
                "the checkpoint interval is shorter than storage can sustain; lengthen "
                "--checkpoint-every-steps/--checkpoint-every-seconds",
                step,
                waited,
                previous,
            )
        t0 = time.monotonic()
        snap = self.staging.snapshot(state())
        job = _Job(step, epoch, reason, snap, waited + time.monotonic() - t0, waited, background)
        if not background:
            return self._persist(job)

        def run() -> None:
            outcome, error = self._persist(job)
            if outcome == FAILED:
                self.failure = Failure(step, reason, error)

        self._in_flight = step
        self._thread = threading.Thread(target=run, name=f"persist-step-{step}", daemon=True)
        self._thread.start()
        return COMMITTED, None  # not yet: a failure surfaces through ``self.failure``

    def _persist(self, job: _Job) -> tuple[int, BaseException | None]:
        try:
            self._commit(job)
            return COMMITTED, None
        except storage.StorageError as e:
            return self._on_failure(job.step, job.reason, e), e
        except Exception as e:
            if not job.background:
                raise
            # In the background nothing else would see it: report it and stop the run.
            logger.exception("CHECKPOINT FAILED at step %d (%s): %s", job.step, job.reason, e)
            self.events.emit(
                Event.CHECKPOINT_FAILED,
                step=job.step,
                reason=job.reason,
                error=f"{type(e).__name__}: {e}",
            )
            return FAILED, e

    def _commit(self, job: _Job) -> None:
        step, reason, blocked = job.step, job.reason, job.blocked
        t0 = time.monotonic()
        job.snap.wait()  # CUDA: the device-to-host copies have landed
        if self._already_committed(step):
            self.last_committed = step
            return
        self._check_attached(step)  # before writing anything, and again right before the commit
        generation = self.generation()
        manifest = self.store.commit(
            step,
            {tstate.state_file_name(generation): job.snap.data},
            self._metadata(step, job.epoch, generation),
            generation=generation,
            before_commit=lambda: self._check_attached(step),
        )
        self.last_committed = step
        persist = time.monotonic() - t0
        deleted = self.store.apply_retention(
            self.keep_last, newest_good=step, keep_every=self.keep_every
        )
        if not job.background:  # the loop waited for all of it
            blocked += time.monotonic() - t0
        logger.info(
            "checkpoint step %d committed (%s): %d bytes, loop blocked %.3fs, persist %.3fs "
            "(%.2f GB/s)",
            step,
            reason,
            manifest.total_bytes,
            blocked,
            persist,
            manifest.total_bytes / max(persist, 1e-9) / 1e9,
        )
        self.events.emit(
            Event.CHECKPOINT,
            step=step,
            reason=reason,
            bytes=manifest.total_bytes,
            blocked_s=round(blocked, 4),
            waited_s=round(job.waited, 4),
            persist_s=round(persist, 4),
            background=job.background,
            deleted=deleted,
        )

    def _check_attached(self, step: int) -> None:
        if not self.attached():
            raise OrphanedError(f"the torchrun agent is gone; not committing step {step}.")

    def _on_failure(self, step: int, reason: str, e: storage.StorageError) -> int:
        """Apply ``--on-storage-failure`` to a storage error; never silent."""
        skippable = (
            isinstance(e, storage.StorageUnavailableError)
            and self.on_failure == "warn"
            and reason not in MUST_COMMIT
        )
        if skippable:
            self.skipped += 1
            logger.error(
                "CHECKPOINT SKIPPED at step %d (%s): %s. Training continues "
                "(--on-storage-failure warn); %d skipped so far, last committed step %s.",
                step,
                reason,
                e,
                self.skipped,
                self.last_committed,
            )
            self.events.emit(
                Event.CHECKPOINT_SKIPPED,
                step=step,
                reason=reason,
                error=f"{type(e).__name__}: {e}",
                skipped_total=self.skipped,
                last_committed=self.last_committed,
            )
            return SKIPPED
        logger.error("CHECKPOINT FAILED at step %d (%s): %s", step, reason, e)
        self.events.emit(
            Event.CHECKPOINT_FAILED, step=step, reason=reason, error=f"{type(e).__name__}: {e}"
        )
        return FAILED

    def _already_committed(self, step: int) -> bool:
        """A good checkpoint of this generation's history at ``step`` is kept (never overwritten).
        A corrupt one, or one a stale older-generation writer left, is un-committed so this step
        is written again: resume skipped it, so nothing can need it."""
        if not self.store.is_committed(step):
            return False
        try:
            existing = self.store.read(step).manifest
        except storage.CheckpointCorruptError as e:
            logger.error("replacing corrupt committed checkpoint at step %d: %s", step, e)
            self.store.delete(step)
            return False
        if existing.generation < self.generation() and self.last_committed != step:
            logger.warning(
                "replacing step %d written by older generation %d (not in this run's history)",
                step,
                existing.generation,
            )
            self.store.delete(step)
            return False
        logger.info("checkpoint step %d is already committed and verifies; keeping it", step)
        return True

    def _metadata(self, step: int, epoch: int, generation: int) -> dict[str, Any]:
        return {
            "step": step,
            "epoch": epoch,
            "world_size": self.world_size,
            "generation": generation,
            "state_file": tstate.state_file_name(generation),
            "versions": {
                "elastictrain": __version__,
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
            "saved_at": time.time(),
        }

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

import dataclasses
import enum
import logging
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import storage
from elastictrain.checkpoint.api import Layout, Reason, SaveOutcome, Snap
from elastictrain.checkpoint.policies import FailurePolicy
from elastictrain.checkpoint.record import Failure, SaveRecord
from elastictrain.config import CheckpointConfig
from elastictrain.errors import NumericalFaultError, OrphanedError
from elastictrain.observe.events import EventLog
from elastictrain.version import __version__

logger = logging.getLogger(__name__)


class Existing(str, enum.Enum):
    """What a committer finds at a step it is about to commit."""

    NONE = "none"
    """No checkpoint: write it."""
    KEEP = "keep"
    """A good one of this run's history: it is never written again."""
    REPLACE = "replace"
    """One that does not verify, or an older generation's outside this history: the new one is
    published over it, and it is deleted only then."""


@dataclass(frozen=True)
class _Job:
    """One checkpoint on its way to storage."""

    step: int
    epoch: int
    reason: Reason
    snap: Snap
    """The layout's snapshot: one flat file (DDP), or this rank's shards (FSDP)."""
    blocked: float
    """What the loop has waited so far: the wait for the previous persist, plus the snapshot."""
    waited: float
    background: bool
    commit: bool = True
    """False: only this rank's files (the caller commits once every rank has written)."""


class Persister:
    """One per writing rank (rank 0 with DDP; every rank with sharded state). ``save`` blocks
    for the snapshot; ``background=False`` also waits for the write (and commit) and returns the
    outcome. Only the committer (rank 0) commits, applies retention and reports checkpoints."""

    def __init__(
        self,
        *,
        store: storage.Store,
        layout: Layout,
        config: CheckpointConfig,
        record: SaveRecord,
        policy: FailurePolicy,
        world_size: int,
        generation: Callable[[], int],
        events: EventLog,
        attached: Callable[[], bool],
        is_committer: bool = True,
    ) -> None:
        """``config``: retention (``keep_last``, ``keep_every_steps``) and how long rank 0 waits
        for every rank's shards (``checkpoint_timeout``)."""
        self.store, self.layout, self.record, self.policy = store, layout, record, policy
        self.config = config
        self.world_size = world_size
        self.generation = generation
        self.events = events
        self.attached = attached
        self.is_committer = is_committer
        self.abandoned: set[int] = set()
        """Steps some rank gave up writing (agreed by the loop): rank 0 stops waiting for them."""
        self._thread: threading.Thread | None = None
        self._in_flight: int | None = None
        self._pending: _Job | None = None

    @property
    def writing(self) -> bool:
        """A background persist is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> float:
        """Wait for the persist in flight, if any; returns the seconds waited."""
        if self._thread is None:
            return 0.0
        t0 = time.monotonic()
        self._thread.join()
        self._thread, self._in_flight = None, None
        return time.monotonic() - t0

    def save(
        self,
        step: int,
        epoch: int,
        reason: Reason,
        state: Callable[[], Any],
        *,
        background: bool,
        commit: bool = True,
    ) -> tuple[SaveOutcome, BaseException | None]:
        """Snapshot ``state()`` now; persist it in the background or before returning.
        ``commit=False`` (sharded, in the foreground): write this rank's files only; the caller
        calls :meth:`commit_pending` on rank 0 once every rank has. In the background the outcome
        is COMMITTED for now: a failure lands in the record."""
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
        if self.record.failure is not None:
            # The previous one failed for good: the run is stopping (the next agreement raises
            # it on every rank). Another write to the same storage would only add a failure.
            return SaveOutcome.FAILED, self.record.failure.error
        t0 = time.monotonic()
        snap = self.layout.snapshot(state())
        job = _Job(
            step, epoch, reason, snap, waited + time.monotonic() - t0, waited, background, commit
        )
        if not background:
            self._pending = job
            return self._persist(job)

        def run() -> None:
            outcome, error = self._persist(job)
            if outcome in (SaveOutcome.FAILED, SaveOutcome.NON_FINITE):
                self.record.failed(Failure(step, reason, error))
            elif outcome is SaveOutcome.SKIPPED:
                self.record.gave_up(step)

        self._in_flight = step
        self._thread = threading.Thread(
            target=run, name=f"elastictrain-persist-step-{step}", daemon=True
        )
        self._thread.start()
        return SaveOutcome.COMMITTED, None

    def commit_pending(self) -> tuple[SaveOutcome, BaseException | None]:
        """Rank 0, sharded, foreground: commit the step whose files every rank has written."""
        job = dataclasses.replace(self._pending, commit=True)
        return self._persist(job, write=False)

    def _persist(self, job: _Job, write: bool = True) -> tuple[SaveOutcome, BaseException | None]:
        try:
            self._commit(job, write)
            return SaveOutcome.COMMITTED, None
        except NumericalFaultError as e:  # every rank learns it from the outcome: all stop alike
            self.policy.failed(job.step, job.reason, e, self.record)
            return SaveOutcome.NON_FINITE, e
        except storage.StorageError as e:
            return self.policy.failed(job.step, job.reason, e, self.record), e
        except Exception as e:
            if not job.background:
                raise  # the caller's frame shows it
            return self.policy.failed(job.step, job.reason, e, self.record), e

    def _commit(self, job: _Job, write: bool = True) -> None:
        step, reason, blocked = job.step, job.reason, job.blocked
        t0 = time.monotonic()
        job.snap.wait()  # CUDA: the device-to-host copies have landed
        if self.is_committer and job.commit and self.existing(step) is Existing.KEEP:
            self.record.committed(step)
            return
        self._check_attached(step)  # before writing anything, and again right before the commit
        generation = self.generation()
        if write:
            _refuse_non_finite(job.snap, step, self.policy.label)
            self.layout.write_own(self.store, step, job.snap, generation)
        if not (self.is_committer and job.commit):
            return
        manifest = self.layout.commit(
            self.store,
            step,
            job.snap,
            generation,
            self._metadata(step, job.epoch, generation),
            before_commit=lambda: self._check_attached(step),
            abandoned=lambda s: s in self.abandoned,
            deadline_s=self.config.checkpoint_timeout,
            # Not KEEP, so whatever an older generation committed here is outside this run's
            # history: replaced, even one that landed after the check above (an abandoned
            # epoch's persist, a stale writer). The store never replaces its own generation's
            # or a newer one's (CheckpointExistsError).
            replace_older=True,
        )
        self.record.committed(step)
        persist = time.monotonic() - t0
        deleted = self.store.apply_retention(
            self.config.keep_last, newest_good=step, keep_every=self.config.keep_every_steps
        )
        if not job.background:  # the loop waited for all of it
            blocked += time.monotonic() - t0
        logger.log(
            self.policy.commit_level,
            "%s step %d committed (%s): %d bytes, loop blocked %.3fs, persist %.3fs (%.2f GB/s)%s",
            self.policy.label,
            step,
            reason,
            manifest.total_bytes,
            blocked,
            persist,
            manifest.total_bytes / max(persist, 1e-9) / 1e9,
            f"; deleted step{'s' if len(deleted) > 1 else ''} {', '.join(map(str, deleted))}"
            if deleted
            else "",
        )
        self.events.emit(
            self.policy.commit_event,
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

    def existing(self, step: int) -> Existing:
        """What is already committed at ``step`` (the committer's question, asked before it
        writes). Nothing is deleted or un-committed here: a checkpoint to replace stays committed
        until the new one is published over it (``replace_older``)."""
        if not self.store.is_committed(step):
            return Existing.NONE
        try:
            manifest = self.store.read(step).manifest
        except storage.CheckpointCorruptError as e:
            logger.error(
                "committed checkpoint at step %d does not verify (%s): a new one will be "
                "published over it",
                step,
                e,
            )
            return Existing.REPLACE
        if manifest.generation < self.generation() and self.record.last_committed != step:
            logger.warning(
                "step %d was committed by older generation %d, outside this run's history: a "
                "new one will be published over it",
                step,
                manifest.generation,
            )
            return Existing.REPLACE
        logger.info("checkpoint step %d is already committed and verifies; keeping it", step)
        return Existing.KEEP

    def _metadata(self, step: int, epoch: int, generation: int) -> dict[str, Any]:
        return {
            "step": step,
            "epoch": epoch,
            "world_size": self.world_size,
            "generation": generation,
            "versions": {
                "elastictrain": __version__,
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
            "saved_at": time.time(),
        }


def _refuse_non_finite(snap: Snap, step: int, label: str) -> None:
    """No checkpoint holds a NaN or an infinity: a run resumed from one could never recover.
    Checked on the copy in host memory, off the training thread, before any byte is written."""
    bad = snap.non_finite()
    if bad:
        shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise NumericalFaultError(
            f"the {label} at step {step} would hold non-finite values (NaN or infinity) in "
            f"{shown}; it was not written, and every committed checkpoint is finite. The state "
            "went bad outside a gradient (a step with a non-finite gradient is never applied): "
            "a buffer such as BatchNorm's statistics, Task.state, or a device that computes "
            "wrong. Resume from the last committed checkpoint, and look for the cause there."
        )

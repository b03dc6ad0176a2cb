"""Checkpoint schedule, rank-0 save, and resume with one storage read per job."""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import storage
from elastictrain import dist as edist
from elastictrain import state as tstate
from elastictrain.errors import CheckpointFailedError, OrphanedError
from elastictrain.events import EventLog
from elastictrain.version import __version__

logger = logging.getLogger(__name__)

# Outcomes of a save, broadcast from rank 0 so every rank acts on the same one.
_COMMITTED, _SKIPPED, _FAILED = 0, 1, 2
# Checkpoints the run cannot go on without: the end of training, and the one a preemption waits for.
_MUST_COMMIT = ("final", "preempt")


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


@dataclass(frozen=True)
class Resumed:
    step: int
    """Completed steps held by the checkpoint; training continues at this step index."""
    checkpoint_step: int | None


class Checkpointer:
    """Owns the store (rank 0 only) and the save/resume protocol.

    Rank-0-only side effects sit behind ``self.is_writer``.
    """

    def __init__(
        self,
        *,
        url: str,
        storage_options: dict[str, str],
        retry_deadline: float,
        rank: int,
        world_size: int,
        generation: int,
        control: dist.ProcessGroup,
        device: torch.device,
        events: EventLog,
        keep_last: int,
        keep_every: int | None = None,
        read_mode: str = "rank0",
        on_failure: str = "warn",
        attached: Callable[[], bool] = lambda: True,
    ) -> None:
        self.is_writer = rank == 0
        self.world_size = world_size
        self.generation = generation
        self.control = control
        self.device = device
        self.events = events
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.read_mode = read_mode
        self.on_failure = on_failure
        """``--on-storage-failure``: ``warn`` skips a scheduled checkpoint storage rejects."""
        self.skipped = 0
        self.attached = attached
        """False once our torchrun agent is gone: an orphan must never commit (zombie writer)."""
        self.store: storage.CheckpointStore | None = None
        self.last_committed: int | None = None
        if self.is_writer or read_mode == "all":
            self.store = storage.open_store(
                url,
                storage_options=storage_options,
                retry=storage.RetryPolicy(deadline_s=retry_deadline),
            )

    def preflight(self) -> None:
        """Rank 0 proves the location is usable before any compute is spent."""
        if self.is_writer:
            self.store.probe()

    def claim(self) -> int:
        """Claim the store for this generation, fencing out older writers. Done after a
        successful resume, so a run that fails its checks (a mismatched model) changes nothing.
        Every rank learns the fenced generation."""
        claimed = self.store.advance_fence(self.generation) if self.is_writer else -1
        self.generation = edist.broadcast_int(claimed, self.control)
        return self.generation

    # -- resume --------------------------------------------------------------------------------
    def resume(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        fingerprint: tstate.DataFingerprint,
    ) -> Resumed:
        """Rank 0 picks the latest good checkpoint; its bytes reach every rank (``read_mode``)."""
        t0 = time.monotonic()
        data, manifest, where = self._fetch_latest()
        if not data:
            dist.barrier(group=self.control)
            logger.info("no committed checkpoint found: starting fresh")
            self.events.emit("resume", fresh=True, step=0, world_size=self.world_size)
            return Resumed(step=0, checkpoint_step=None)
        state = tstate.from_bytes(data, map_location=self.device)
        tstate.check_compatible(model, state, fingerprint, where=where)
        step = tstate.restore(model, optimizer, scheduler, state)
        self.last_committed = step
        seconds = time.monotonic() - t0
        dist.barrier(group=self.control)
        logger.info("resumed from checkpoint step %d (%d bytes, %.2fs)", step, len(data), seconds)
        saved_world = manifest.metadata.get("world_size") if manifest else None
        self.events.emit(
            "resume",
            fresh=False,
            step=step,
            bytes=len(data),
            seconds=round(seconds, 4),
            world_size=self.world_size,
            saved_world_size=saved_world,
            generation=self.generation,
        )
        if self.is_writer and saved_world is not None and saved_world != self.world_size:
            logger.warning(
                "membership change: world size %s -> %d, resuming from step %d; the global batch "
                "stays the same, per-rank shares change",
                saved_world,
                self.world_size,
                step,
            )
            self.events.emit(
                "membership", old_world_size=saved_world, new_world_size=self.world_size, step=step
            )
        return Resumed(step=step, checkpoint_step=step)

    def _fetch_latest(self) -> tuple[bytes | bytearray, storage.Manifest | None, str]:
        """The chosen checkpoint's state bytes on every rank (empty when there is none).

        ``rank0`` reads storage once per job and broadcasts; ``all`` broadcasts only the step and
        lets every rank read and verify it (for states too large to hold twice or to broadcast).
        """
        ckpt = self.store.latest() if self.is_writer else None
        where = (
            f"step {ckpt.manifest.step} under {self.store.safe_url}" if ckpt else "chosen by rank 0"
        )
        if self.read_mode == "all":
            step = edist.broadcast_int(ckpt.manifest.step if ckpt else -1, self.control)
            if step < 0:
                return b"", None, where
            if not self.is_writer:
                ckpt = self.store.read(step)
            return ckpt.files[tstate.state_file_of(ckpt.manifest.metadata)], ckpt.manifest, where
        # The broadcast is the gate: no rank proceeds until rank 0 has chosen.
        payload = ckpt.files[tstate.state_file_of(ckpt.manifest.metadata)] if ckpt else None
        return edist.broadcast_bytes(payload, self.control), ckpt.manifest if ckpt else None, where

    # -- save ----------------------------------------------------------------------------------
    def save(
        self,
        *,
        step: int,
        epoch: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        fingerprint: tstate.DataFingerprint,
        reason: str,
    ) -> bool:
        """Synchronous: rank 0 commits, then broadcasts the outcome, which doubles as the
        tutorial's save + barrier (no collective waits on storage with the shorter collective
        timeout). Returns True when step ``step`` is committed, False when it was skipped under
        ``--on-storage-failure warn``; raises on every rank when the run cannot go on."""
        if self.last_committed == step:
            return True
        outcome, error = _COMMITTED, None
        if self.is_writer:

            def serialize() -> bytes:
                state = tstate.capture(
                    model, optimizer, scheduler, step=step, fingerprint=fingerprint
                )
                return tstate.to_bytes(state)

            try:
                self._commit(step, epoch, reason, serialize)
            except storage.StorageError as e:
                outcome, error = self._on_failure(step, reason, e), e
        outcome = edist.broadcast_int(outcome, self.control)
        if outcome == _FAILED:
            detail = f": {error}" if error else "; see rank 0's log for the storage error"
            raise CheckpointFailedError(
                f"the {reason} checkpoint at step {step} could not be committed{detail}"
            ) from error
        if outcome == _COMMITTED:
            self.last_committed = step
        return outcome == _COMMITTED

    def _on_failure(self, step: int, reason: str, e: storage.StorageError) -> int:
        """Rank 0: apply ``--on-storage-failure`` to a storage error; never silent."""
        skippable = (
            isinstance(e, storage.StorageUnavailableError)
            and self.on_failure == "warn"
            and reason not in _MUST_COMMIT
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
                "checkpoint_skipped",
                step=step,
                reason=reason,
                error=f"{type(e).__name__}: {e}",
                skipped_total=self.skipped,
                last_committed=self.last_committed,
            )
            return _SKIPPED
        logger.error("CHECKPOINT FAILED at step %d (%s): %s", step, reason, e)
        self.events.emit(
            "checkpoint_failed", step=step, reason=reason, error=f"{type(e).__name__}: {e}"
        )
        return _FAILED

    def _commit(self, step: int, epoch: int, reason: str, serialize: Callable[[], bytes]) -> None:
        """Rank 0: serialise, commit, apply retention, report."""
        t0 = time.monotonic()
        if self._already_committed(step):
            return
        blob = serialize()
        t_snap = time.monotonic()
        if not self.attached():
            raise OrphanedError(f"the torchrun agent is gone; not committing step {step}.")
        manifest = self.store.commit(
            step,
            {tstate.state_file_name(self.generation): blob},
            self._metadata(step, epoch),
            generation=self.generation,
        )
        t_commit = time.monotonic()
        deleted = self.store.apply_retention(
            self.keep_last, newest_good=step, keep_every=self.keep_every
        )
        blocked = time.monotonic() - t0
        logger.info(
            "checkpoint step %d committed (%s): %d bytes, serialize %.3fs, persist %.3fs, "
            "loop blocked %.3fs",
            step,
            reason,
            manifest.total_bytes,
            t_snap - t0,
            t_commit - t_snap,
            blocked,
        )
        self.events.emit(
            "checkpoint",
            step=step,
            reason=reason,
            bytes=manifest.total_bytes,
            blocked_s=round(blocked, 4),
            persist_s=round(t_commit - t_snap, 4),
            serialize_s=round(t_snap - t0, 4),
            deleted=deleted,
        )

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
        if existing.generation < self.generation and self.last_committed != step:
            logger.warning(
                "replacing step %d written by older generation %d (not in this run's history)",
                step,
                existing.generation,
            )
            self.store.delete(step)
            return False
        logger.info("checkpoint step %d is already committed and verifies; keeping it", step)
        return True

    def _metadata(self, step: int, epoch: int) -> dict[str, Any]:
        return {
            "step": step,
            "epoch": epoch,
            "world_size": self.world_size,
            "generation": self.generation,
            "state_file": tstate.state_file_name(self.generation),
            "versions": {
                "elastictrain": __version__,
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
            "saved_at": time.time(),
        }

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
from elastictrain.events import EventLog
from elastictrain.version import __version__

logger = logging.getLogger(__name__)


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
    ) -> None:
        self.is_writer = rank == 0
        self.world_size = world_size
        self.generation = generation
        self.control = control
        self.device = device
        self.events = events
        self.keep_last = keep_last
        self.store: storage.CheckpointStore | None = None
        self.last_committed: int | None = None
        if self.is_writer:
            self.store = storage.open_store(
                url,
                storage_options=storage_options,
                retry=storage.RetryPolicy(deadline_s=retry_deadline),
            )

    def preflight(self) -> None:
        """Rank 0 proves the location is usable before any compute is spent."""
        if self.is_writer:
            self.store.probe()

    # -- resume --------------------------------------------------------------------------------
    def resume(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        fingerprint: tstate.DataFingerprint,
    ) -> Resumed:
        """Rank 0 reads the latest good checkpoint once and broadcasts its bytes; all ranks load it."""
        t0 = time.monotonic()
        payload: bytes | None = None
        where = "none"
        if self.is_writer:
            ckpt = self.store.latest()
            if ckpt is not None:
                payload = ckpt.files[tstate.STATE_FILE]
                where = f"step {ckpt.manifest.step} under {self.store.safe_url}"
        # The broadcast is the barrier: no rank proceeds until rank 0 has chosen.
        data = edist.broadcast_bytes(payload, self.control)
        if not data:
            dist.barrier(group=self.control)
            logger.info("no committed checkpoint found: starting fresh")
            self.events.emit("resume", fresh=True, step=0)
            return Resumed(step=0, checkpoint_step=None)
        state = tstate.from_bytes(data, map_location=self.device)
        tstate.check_compatible(
            model, state, fingerprint, where=where if self.is_writer else "chosen by rank 0"
        )
        step = tstate.restore(model, optimizer, scheduler, state)
        self.last_committed = step
        seconds = time.monotonic() - t0
        dist.barrier(group=self.control)
        logger.info("resumed from checkpoint step %d (%d bytes, %.2fs)", step, len(data), seconds)
        self.events.emit(
            "resume", fresh=False, step=step, bytes=len(data), seconds=round(seconds, 4)
        )
        return Resumed(step=step, checkpoint_step=step)

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
    ) -> None:
        """Synchronous: rank 0 commits, then every rank passes the control barrier (the tutorial's
        save + barrier), so no collective waits on storage with the shorter collective timeout."""
        if self.last_committed == step:
            return
        t0 = time.monotonic()
        if self.is_writer and self._already_committed(step):
            pass
        elif self.is_writer:
            blob = tstate.to_bytes(
                tstate.capture(model, optimizer, scheduler, step=step, fingerprint=fingerprint)
            )
            t_snap = time.monotonic()
            manifest = self.store.commit(
                step, {tstate.STATE_FILE: blob}, self._metadata(step, epoch)
            )
            t_commit = time.monotonic()
            deleted = self.store.apply_retention(self.keep_last, newest_good=step)
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
        dist.barrier(group=self.control)
        self.last_committed = step

    def _already_committed(self, step: int) -> bool:
        """A good checkpoint at ``step`` is kept (never overwritten); a corrupt one is un-committed
        so this step can be written again (it was skipped at resume, so nothing can need it)."""
        if not self.store.is_committed(step):
            return False
        try:
            self.store.read(step)
        except storage.CheckpointCorruptError as e:
            logger.error("replacing corrupt committed checkpoint at step %d: %s", step, e)
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
            "versions": {
                "elastictrain": __version__,
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
            "saved_at": time.time(),
        }

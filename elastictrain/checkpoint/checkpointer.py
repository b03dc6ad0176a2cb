"""The save/resume protocol across ranks: rank 0 saves, every rank resumes from one storage read."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import storage
from elastictrain import dist as edist
from elastictrain.checkpoint import state as tstate
from elastictrain.checkpoint.persist import COMMITTED, FAILED, MUST_COMMIT, Failure, Persister
from elastictrain.errors import CheckpointFailedError
from elastictrain.observe.events import Event, EventLog

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resumed:
    step: int
    """Completed steps held by the checkpoint; training continues at this step index."""
    checkpoint_step: int | None
    extra: dict[str, Any] | None = None
    """The ``extra`` state saved with the checkpoint (library mode), or None."""


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
        control: dist.ProcessGroup | None,
        device: torch.device,
        events: EventLog,
        keep_last: int,
        keep_every: int | None = None,
        read_mode: str = "rank0",
        on_failure: str = "warn",
        async_persist: bool = True,
        attached: Callable[[], bool] = lambda: True,
    ) -> None:
        self.is_writer = rank == 0
        self.world_size = world_size
        self.generation = generation
        self.control = control
        self.device = device
        self.events = events
        self.read_mode = read_mode
        self.async_persist = async_persist
        self.store: storage.CheckpointStore | None = None
        self.writer: Persister | None = None
        self._last_committed: int | None = None
        if self.is_writer or read_mode == "all":
            self.store = storage.open_store(
                url,
                storage_options=storage_options,
                retry=storage.RetryPolicy(deadline_s=retry_deadline),
            )
        if self.is_writer:
            self.writer = Persister(
                store=self.store,
                world_size=world_size,
                generation=lambda: self.generation,
                events=events,
                keep_last=keep_last,
                keep_every=keep_every,
                on_failure=on_failure,
                # False once our torchrun agent is gone: an orphan must never commit.
                attached=attached,
            )

    @property
    def last_committed(self) -> int | None:
        """The newest step this attempt resumed from or committed (rank 0: including ones
        committed in the background)."""
        return self.writer.last_committed if self.writer else self._last_committed

    @last_committed.setter
    def last_committed(self, step: int | None) -> None:
        if self.writer:
            self.writer.last_committed = step
        self._last_committed = step

    @property
    def skipped(self) -> int:
        return self.writer.skipped if self.writer else 0

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
    def resume(self, state: tstate.TrainState) -> Resumed:
        """Rank 0 picks the latest good checkpoint; its bytes reach every rank (``read_mode``)."""
        t0 = time.monotonic()
        data, manifest, where = self._fetch_latest()
        if not data:
            edist.barrier(self.control)
            logger.info("no committed checkpoint found: starting fresh")
            self.events.emit(Event.RESUME, fresh=True, step=0, world_size=self.world_size)
            return Resumed(step=0, checkpoint_step=None)
        payload = tstate.from_bytes(data, map_location=self.device)
        tstate.check_compatible(state, payload, where=where)
        step = tstate.restore(state, payload)
        self.last_committed = step
        seconds = time.monotonic() - t0
        edist.barrier(self.control)
        logger.info("resumed from checkpoint step %d (%d bytes, %.2fs)", step, len(data), seconds)
        saved_world = manifest.metadata.get("world_size") if manifest else None
        self.events.emit(
            Event.RESUME,
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
                Event.MEMBERSHIP,
                old_world_size=saved_world,
                new_world_size=self.world_size,
                step=step,
            )
        return Resumed(step=step, checkpoint_step=step, extra=payload.get("extra"))

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
    def save(self, step: int, state: tstate.TrainState, reason: str) -> bool:
        """Checkpoint ``step``. Rank 0 snapshots the state; other ranks do not wait for it.

        A scheduled checkpoint with ``async_persist`` is persisted in the background: this returns
        once the snapshot is taken, with no collective, and a failure surfaces later through
        :attr:`failure`. The final and preemption checkpoints (and every one without
        ``async_persist``) are committed before rank 0 broadcasts the outcome, which doubles as the
        tutorial's save + barrier. Returns False when the checkpoint was skipped under
        ``--on-storage-failure warn``; raises on every rank when the run cannot go on.
        """
        if self.last_committed == step:
            return True
        wait_for_commit = reason in MUST_COMMIT or not self.async_persist
        if not wait_for_commit and not self.is_writer:
            return True
        outcome, error = COMMITTED, None
        if self.is_writer:
            outcome, error = self.writer.save(
                step,
                state.epoch_of(step),
                reason,
                lambda: tstate.capture(state, step=step),
                background=not wait_for_commit,
            )
            if not wait_for_commit:
                return True
        outcome = edist.broadcast_int(outcome, self.control)
        if outcome == FAILED:
            detail = f": {error}" if error else "; see rank 0's log for the storage error"
            raise CheckpointFailedError(
                f"the {reason} checkpoint at step {step} could not be committed{detail}"
            ) from error
        if outcome == COMMITTED:
            self.last_committed = step
        return outcome == COMMITTED

    @property
    def failure(self) -> Failure | None:
        """Rank 0: a background persist that failed for good (the loop then stops every rank)."""
        return self.writer.failure if self.writer else None

    def raise_failure(self) -> None:
        """Every rank, once the loop agreed that rank 0's background persist failed."""
        failure = self.failure
        if failure is None:
            raise CheckpointFailedError(
                "rank 0's background checkpoint persist failed; see rank 0's log for the error"
            )
        raise CheckpointFailedError(
            f"the {failure.reason} checkpoint at step {failure.step} could not be committed in "
            f"the background: {type(failure.error).__name__}: {failure.error}"
        ) from failure.error

    def finish(self) -> None:
        """Wait for a background persist still in flight (before exiting)."""
        if self.writer:
            self.writer.wait()

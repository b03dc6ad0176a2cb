"""The save/resume protocol across ranks, whatever the layout: the claim (fencing), the
agreement on a save's outcome, the record of what is committed, the resume report. What differs
between replicated (DDP) and sharded (FSDP2) state is the run's mode (``modes``)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import storage
from elastictrain.checkpoint.api import MUST_COMMIT, Reason, SaveOutcome, Tier
from elastictrain.checkpoint.modes import Mode, mode_for
from elastictrain.checkpoint.policies import StopTheRun
from elastictrain.checkpoint.record import Failure, SaveRecord
from elastictrain.checkpoint.resume import live as live_resume
from elastictrain.checkpoint.resume.report import report_resume
from elastictrain.checkpoint.state import train_state as tstate
from elastictrain.checkpoint.tiers.local import LocalTier
from elastictrain.checkpoint.write import node_check
from elastictrain.checkpoint.write.persist import Existing, Persister
from elastictrain.cluster.collectives import barrier, broadcast_int
from elastictrain.config import CheckpointConfig
from elastictrain.errors import CheckpointFailedError, NumericalFaultError
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
    """Owns the store (rank 0, and every rank that reads or writes shards), the save/resume
    protocol, and this rank's :class:`SaveRecord`. Rank-0-only side effects sit behind
    ``self.is_writer``."""

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        generation: int,
        group: dist.ProcessGroup | None,
        events: EventLog,
        attached: Callable[[], bool] = lambda: True,
        local_world_size: int = 1,
    ) -> None:
        """``group``: the gloo group of the save and resume barriers (None: one process).
        ``attached``: False once our torchrun agent is gone; an orphan must never commit."""
        self.config = config
        self.is_writer = rank == 0
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.local_world_size = local_world_size
        self.generation = generation
        self.group = group
        self.events = events
        self.attached = attached
        self.record = SaveRecord()
        self.store: storage.CheckpointStore | None = None
        self.writer: Persister | None = None
        self.mode: Mode | None = None
        """How the state is laid out: known from the state at the first resume or save."""
        self.local: LocalTier | None = None
        """The node-local tier (a replica; or each rank's shards and its buddy's), set up with
        the layout."""
        self.begun: int | None = None
        """The newest step this session began saving, or resumed from the durable tier: a
        scheduled save of it again is skipped (``save``)."""
        if self.is_writer or config.resume_read == "all":
            self.store = self.open_store()

    def open_store(self) -> storage.CheckpointStore:
        """A new store (own backend and retries) for whoever asks: the history writer, a reader."""
        return storage.open_store(
            self.config.checkpoint_dir,
            storage_options=dict(self.config.storage_options),
            retry=storage.RetryPolicy(deadline_s=self.config.storage_retry_deadline),
            checksum=self.config.checksum,
        )

    def _setup(self, state: tstate.TrainState) -> None:
        """Pick the mode from the state, once (``modes.mode_for``)."""
        if self.mode is not None:
            return
        config = self.config
        self.mode = mode_for(state.model)
        if self.mode.every_rank_writes and self.store is None:
            self.store = self.open_store()
        if self.is_writer or self.mode.every_rank_writes:
            self.writer = Persister(
                store=self.store,
                layout=self.mode.layout(self.rank, self.world_size),
                config=config,
                record=self.record,
                policy=StopTheRun(config, self.events),
                world_size=self.world_size,
                generation=lambda: self.generation,
                events=self.events,
                attached=self.attached,
                is_committer=self.is_writer,
            )
        if not config.local_checkpoint:
            return
        if state.per_rank:
            if self.is_writer:
                logger.info(
                    "local checkpoint tier off: a stream's per-rank positions are gathered at "
                    "durable checkpoints only, so resume reads the durable tier"
                )
            return
        self.local = self.mode.node_tier(
            self,
            rank=self.rank,
            local_rank=self.local_rank,
            world_size=self.world_size,
            generation=lambda: self.generation,
            events=self.events,
            attached=self.attached,
        )

    # -- what the record holds -------------------------------------------------------------------
    @property
    def last_committed(self) -> int | None:
        """The newest step on the durable tier that this attempt resumed from or committed (rank 0:
        including ones committed in the background). A resume from node memory leaves the
        durable tier's newest here."""
        return self.record.last_committed

    @property
    def last_local(self) -> int | None:
        """This node's newest local-tier copy, if this rank writes one."""
        return self.local.newest if self.local is not None else None

    @property
    def skipped(self) -> int:
        """Scheduled checkpoints skipped under ``on_storage_failure="warn"``."""
        return self.record.skipped

    @property
    def failure(self) -> Failure | None:
        """A background persist of this rank's that failed for good (the loop then stops every
        rank)."""
        return self.record.failure

    @property
    def skipped_step(self) -> int | None:
        """The newest step this rank gave up writing in the background (sharded)."""
        return self.record.skipped_step

    def preflight(self, *, local_world_size: int, setting: str) -> None:
        """Rank 0 proves the location is usable before any compute is spent; in a multi-node
        job every node then proves it sees that same location (``node_check``)."""
        if self.is_writer:
            self.store.probe()
        if self.world_size > local_world_size:
            reads = self.is_writer or self.local_rank == 0
            node_check.check_shared_storage(
                (self.store or self.open_store()) if reads else None,
                self.group,
                rank=self.rank,
                world_size=self.world_size,
                local_rank=self.local_rank,
                local_world_size=local_world_size,
                generation=self.generation,
                setting=setting,
            )

    def claim(self) -> int:
        """Claim the store for this generation, fencing out older writers. Done after a
        successful resume, so a run that fails its checks (a mismatched model) changes nothing.
        Every rank learns the fenced generation."""
        claimed = self.store.advance_fence(self.generation) if self.is_writer else -1
        self.generation = broadcast_int(claimed, self.group)
        return self.generation

    # -- resume --------------------------------------------------------------------------------
    def resume(
        self, state: tstate.TrainState, device: torch.device, live: live_resume.Live | None = None
    ) -> Resumed:
        """Rank 0 picks the latest good checkpoint; its bytes reach every rank (``resume_read``),
        its tensors mapped to ``device``. Sharded: every rank reads the byte ranges of its own new
        shards. ``live``: an in-place epoch's state comes from a survivor's memory instead."""
        self._setup(state)
        t0 = time.monotonic()
        if live is not None:
            live = dataclasses.replace(live, durable_step=self._newest_durable(live.durable_step))
            restored = self.mode.fetch_live(self, state, device, live)
        else:
            restored = self.mode.fetch(self, state, device)
        if restored is None:
            return self._fresh()
        payload = restored.payload
        step = int(payload["progress"]["step"])
        self.record.committed(restored.origin.committed_step(step))
        self.begun = step if restored.origin.tier is Tier.DURABLE else None
        seconds = time.monotonic() - t0
        barrier(self.group)
        report_resume(
            self.events,
            step=step,
            seconds=seconds,
            restored=restored,
            world_size=self.world_size,
            generation=self.generation,
            is_writer=self.is_writer,
        )
        return Resumed(step=step, checkpoint_step=step, extra=payload.get("extra"))

    def _newest_durable(self, known: int | None) -> int | None:
        """Every rank: the newest committed step, from storage (only a dead rank 0 knew of its
        last background commits); ``known`` if storage cannot say now."""
        newest = known
        if self.is_writer:
            try:
                newest = max(self.store.committed_steps(), default=known)
            except storage.StorageError as e:
                logger.warning("newest committed step unknown (%s); assuming %s", e, known)
        newest = broadcast_int(-1 if newest is None else newest, self.group)
        return None if newest < 0 else newest

    def _fresh(self) -> Resumed:
        barrier(self.group)
        logger.info("no committed checkpoint found: starting fresh")
        self.events.emit(Event.RESUME, fresh=True, step=0, world_size=self.world_size)
        return Resumed(step=0, checkpoint_step=None)

    def report_corrupt(self, step: int, error: Exception | str, tier: Tier) -> None:
        self.events.emit(Event.CORRUPT, step=step, tier=tier, error=str(error)[:500])

    # -- save ----------------------------------------------------------------------------------
    def save(self, step: int, state: tstate.TrainState, reason: Reason) -> bool:
        """Checkpoint ``step``. Rank 0 snapshots the state; other ranks do not wait for it.

        A scheduled checkpoint with ``async_checkpoint`` is persisted in the background: this
        returns once the snapshot is taken, with no collective, and a failure surfaces later
        through :attr:`failure`. The final and preemption checkpoints (and every one without
        ``async_checkpoint``) are committed before rank 0 broadcasts the outcome, which doubles as
        the tutorial's save + barrier; once they are, the local tier's copies go (the durable
        tier holds the newest state, and /dev/shm is memory). Returns False when the checkpoint
        was skipped under ``--on-storage-failure warn``; raises on every rank when the run cannot
        go on.
        """
        self._setup(state)
        if step == self.begun and not self.waits_for_commit(reason):
            # Saved already in this session (``step(N)`` twice under gradient accumulation, or
            # ``step(N)`` then ``save(N)``), or resumed from: every rank calls this with the same
            # steps, so every rank skips it alike, with no collective. Writing it again would
            # only race the first persist for the same names.
            return True
        self.begun = step
        committed = self.mode.save(self, step, state, reason)
        if committed and reason in MUST_COMMIT and self.local is not None:
            self.local.remove()
        return committed

    def waits_for_commit(self, reason: Reason) -> bool:
        """A save the caller must see committed: final, preemption, or any without
        ``async_checkpoint``."""
        return reason in MUST_COMMIT or not self.config.async_checkpoint

    def agree_already_committed(self, step: int) -> bool:
        """Every rank: rank 0 says whether ``step`` is committed and kept, by its record (a
        background commit) or by storage (a commit whose reply was lost, an earlier attempt's);
        then no rank writes a file of it again."""
        kept = False
        if self.is_writer:
            if self.writer is not None:
                self.writer.wait()  # a background persist of this very step settles first
            kept = self.last_committed == step
            if not kept and self.writer is not None:
                try:
                    kept = self.writer.existing(step) is Existing.KEEP
                except storage.StorageError as e:  # the save that follows meets it, and says so
                    logger.warning("could not check whether step %d is committed: %s", step, e)
        if broadcast_int(int(kept), self.group):
            self.record.committed(step)
            return True
        return False

    def settle(self, step: int, reason: Reason, outcome: int, error: BaseException | None) -> bool:
        """Every rank acts on the agreed outcome of a foreground save."""
        outcome = SaveOutcome(outcome)
        if outcome is SaveOutcome.NON_FINITE:
            if isinstance(error, NumericalFaultError):
                raise error
            raise NumericalFaultError(
                f"the {reason} checkpoint at step {step} was refused: another rank's copy held "
                "a NaN or an infinity (its log names the tensors); every committed checkpoint "
                "is finite"
            )
        if outcome is SaveOutcome.FAILED:
            detail = f": {error}" if error else "; see rank 0's log for the storage error"
            raise CheckpointFailedError(
                f"the {reason} checkpoint at step {step} could not be committed{detail}"
            ) from error
        if outcome is SaveOutcome.COMMITTED:
            self.record.committed(step)
        return outcome is SaveOutcome.COMMITTED

    def after_step(self, step: int, state: tstate.TrainState, *, durable_saved: bool) -> None:
        """Every rank after every step: the local tier takes its copy when one is due."""
        if self.local is not None:
            self.local.after_step(step, state, durable_saved=durable_saved)

    def abandon(self, step: int) -> None:
        """Some rank gave up on ``step``: rank 0 stops waiting for its shards."""
        if self.writer:
            self.writer.abandoned.add(step)

    @property
    def failure_code(self) -> int:
        """What this rank tells the agreement of :attr:`failure`: 0 none, 1 a failure, 2 a copy
        refused for holding a NaN or an infinity (then every rank stops with exit 10)."""
        failure = self.failure
        if failure is None:
            return 0
        return 2 if isinstance(failure.error, NumericalFaultError) else 1

    def raise_failure(self, code: int = 1) -> None:
        """Every rank, once the loop agreed that a background persist failed (``code``: the
        agreed :attr:`failure_code`)."""
        failure = self.failure
        if failure is None and code == 2:
            raise NumericalFaultError(
                "another rank's background checkpoint copy held a NaN or an infinity (its log "
                "names the tensors); it was not written, and every committed checkpoint is finite"
            )
        if failure is None:
            raise CheckpointFailedError(
                "another rank's background checkpoint persist failed; see its log for the error"
            )
        if isinstance(failure.error, NumericalFaultError):
            raise failure.error
        raise CheckpointFailedError(
            f"the {failure.reason} checkpoint at step {failure.step} could not be committed in "
            f"the background: {type(failure.error).__name__}: {failure.error}"
        ) from failure.error

    def finish(self) -> None:
        """Wait for a background persist still in flight (before exiting)."""
        if self.writer:
            self.writer.wait()
        if self.local:
            self.local.finish()

"""The save/resume protocol across ranks.

Replicated state (DDP): rank 0 saves, and every rank resumes from one storage read. Sharded state
(FSDP2, found from the model's DTensor parameters): every rank saves its own shards and reads only
the byte ranges it needs at any world size; rank 0 commits (``sharded``, ``layouts``).
"""

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
from elastictrain.checkpoint import node_check, shard_reader, sharded, tiers
from elastictrain.checkpoint import state as tstate
from elastictrain.checkpoint.layouts import FlatLayout, ShardedLayout
from elastictrain.checkpoint.local_tier import LocalTier, LocalTierConfig
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
        gate_timeout_s: float = 1800.0,
        checksum: str = storage.DEFAULT_ALGORITHM,
        local: LocalTierConfig | None = None,
        local_rank: int = 0,
    ) -> None:
        self.is_writer = rank == 0
        self.rank = rank
        self.world_size = world_size
        self.generation = generation
        self.control = control
        self.device = device
        self.events = events
        self.read_mode = read_mode
        self.async_persist = async_persist
        self.store: storage.CheckpointStore | None = None
        self.writer: Persister | None = None
        self.sharded: bool | None = None
        """Known from the state at the first resume or save."""
        self._last_committed: int | None = None
        # A new store (own backend and retries) for whoever asks: the history writer, a reader.
        self.open_store = lambda: storage.open_store(
            url,
            storage_options=storage_options,
            retry=storage.RetryPolicy(deadline_s=retry_deadline),
            checksum=checksum,
        )
        self._url, self._checksum, self._attached = url, checksum, attached
        self._local_config = local or LocalTierConfig(enabled=False)
        self.local_rank = local_rank
        self.local: LocalTier | None = None
        """The node-local tier (replicated state only), set up with the layout."""
        if self.is_writer or read_mode == "all":
            self.store = self.open_store()
        self._writer_args = dict(
            world_size=world_size,
            generation=lambda: self.generation,
            events=events,
            keep_last=keep_last,
            keep_every=keep_every,
            on_failure=on_failure,
            # False once our torchrun agent is gone: an orphan must never commit.
            attached=attached,
            reports_timeout_s=gate_timeout_s,
        )

    def _setup(self, state: tstate.TrainState) -> None:
        """Pick the layout from the state: sharded parameters are saved by every rank."""
        if self.sharded is not None:
            return
        self.sharded = sharded.is_sharded(state.model)
        if self.sharded and self.store is None:
            self.store = self.open_store()
        if self.is_writer or self.sharded:
            layout = ShardedLayout(self.rank, self.world_size) if self.sharded else FlatLayout()
            self.writer = Persister(
                store=self.store, layout=layout, is_committer=self.is_writer, **self._writer_args
            )
        if self._local_config.enabled and (self.sharded or state.per_rank):
            if self.is_writer:
                logger.info(
                    "local checkpoint tier off: %s, so resume reads the durable tier",
                    "sharded (FSDP) state; a node holds only its own shards"
                    if self.sharded
                    else "a stream's per-rank positions are gathered at durable checkpoints only",
                )
        elif self._local_config.enabled:
            self.local = LocalTier(
                self._local_config,
                durable_url=self._url,
                rank=self.rank,
                local_rank=self.local_rank,
                world_size=self.world_size,
                generation=lambda: self.generation,
                events=self.events,
                attached=self._attached,
                checksum=self._checksum,
            )

    @property
    def last_committed(self) -> int | None:
        """The newest step this attempt resumed from or committed (rank 0: including ones
        committed in the background)."""
        return (
            self.writer.last_committed if self.is_writer and self.writer else self._last_committed
        )

    @last_committed.setter
    def last_committed(self, step: int | None) -> None:
        if self.writer:
            self.writer.last_committed = step
        self._last_committed = step

    @property
    def skipped(self) -> int:
        return self.writer.skipped if self.writer else 0

    def preflight(self, *, local_rank: int, local_world_size: int, setting: str) -> None:
        """Rank 0 proves the location is usable before any compute is spent; in a multi-node
        job every node then proves it sees that same location (``node_check``)."""
        if self.is_writer:
            self.store.probe()
        if self.world_size > local_world_size:
            reads = self.is_writer or local_rank == 0
            node_check.check_shared_storage(
                (self.store or self.open_store()) if reads else None,
                self.control,
                rank=self.rank,
                world_size=self.world_size,
                local_rank=local_rank,
                local_world_size=local_world_size,
                generation=self.generation,
                setting=setting,
            )

    def claim(self) -> int:
        """Claim the store for this generation, fencing out older writers. Done after a
        successful resume, so a run that fails its checks (a mismatched model) changes nothing.
        Every rank learns the fenced generation."""
        claimed = self.store.advance_fence(self.generation) if self.is_writer else -1
        self.generation = edist.broadcast_int(claimed, self.control)
        return self.generation

    # -- resume --------------------------------------------------------------------------------
    def resume(self, state: tstate.TrainState) -> Resumed:
        """Rank 0 picks the latest good checkpoint; its bytes reach every rank (``read_mode``).
        Sharded: every rank reads the byte ranges of its own new shards."""
        self._setup(state)
        t0 = time.monotonic()
        if self.sharded:
            found = self._load_sharded(state)
            if found is None:
                return self._fresh()
            payload, manifest, nbytes = found
            origin = {"tier": tiers.DURABLE, "remote_bytes": nbytes}
            saved_world = manifest.metadata.get("world_size")
        else:
            found = tiers.fetch_best(self, self.local)
            if found is None:
                return self._fresh()
            payload = tstate.from_bytes(found.data, map_location=self.device)
            tstate.check_compatible(state, payload, where=found.where)
            tstate.restore(state, payload)
            nbytes, saved_world = len(found.data), found.saved_world_size
            origin = {
                "tier": found.tier,
                "source_rank": found.source_rank,
                "durable_step": found.durable_step,
                "remote_bytes": nbytes if found.tier == tiers.DURABLE else 0,
            }
        step = int(payload["progress"]["step"])
        self.last_committed = step
        seconds = time.monotonic() - t0
        edist.barrier(self.control)
        if origin["tier"] == tiers.LOCAL:
            origin["steps_saved"] = step - (origin["durable_step"] or 0)
            logger.info(
                "resumed from the local checkpoint of step %d on rank %d (%d bytes, %.2fs; "
                "%d steps newer than the durable tier's)",
                step,
                origin["source_rank"],
                nbytes,
                seconds,
                origin["steps_saved"],
            )
        else:
            logger.info("resumed from checkpoint step %d (%d bytes, %.2fs)", step, nbytes, seconds)
        self.events.emit(
            Event.RESUME,
            fresh=False,
            step=step,
            bytes=nbytes,
            seconds=round(seconds, 4),
            world_size=self.world_size,
            saved_world_size=saved_world,
            generation=self.generation,
            **origin,
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

    def _fresh(self) -> Resumed:
        edist.barrier(self.control)
        logger.info("no committed checkpoint found: starting fresh")
        self.events.emit(Event.RESUME, fresh=True, step=0, world_size=self.world_size)
        return Resumed(step=0, checkpoint_step=None)

    def _corrupt(self, step: int, error: Exception) -> None:
        logger.error("CORRUPT CHECKPOINT skipped, falling back to an older one: %s", error)
        self.report_corrupt(step, error)

    def report_corrupt(self, step: int, error: Exception | str, tier: str = "durable") -> None:
        self.events.emit(Event.CORRUPT, step=step, tier=tier, error=str(error)[:500])

    def _load_sharded(self, state: tstate.TrainState) -> tuple[dict, storage.Manifest, int] | None:
        """Every rank together: the newest step whose files all exist at their recorded sizes and
        whose every byte range some rank reads verifies. Rank 0 proposes, all read, all agree; a
        bad step (any rank) makes everyone fall back to the next older one."""
        candidates = iter(
            self.store.ranked_manifests(on_corrupt=self._corrupt) if self.is_writer else []
        )
        touched = False
        while True:
            step = -1
            for manifest in candidates:
                try:
                    self.store.check_sizes(manifest)
                    step = manifest.step
                    break
                except storage.CheckpointCorruptError as e:
                    self._corrupt(manifest.step, e)
            step = edist.broadcast_int(step, self.control)
            if step < 0:
                if touched:
                    raise storage.CheckpointCorruptError(
                        f"No sharded checkpoint under {self.store.safe_url!r} verified, and the "
                        "failed attempts overwrote part of this process's state; refusing to "
                        "train from it. Move the checkpoints aside to start fresh."
                    )
                return None
            manifest = self.store.read_manifest(step)
            error = None
            try:
                payload, nbytes = shard_reader.load_into(state, self.store, manifest, self.device)
            except storage.CheckpointCorruptError as e:
                error = e
            touched = True
            if edist.max_int(int(error is not None), self.control) == 0:
                tstate.restore(state, payload, model_and_optimizer=False)
                return payload, manifest, nbytes
            if error is not None:
                logger.error("CORRUPT CHECKPOINT: rank %d read a bad shard: %s", self.rank, error)
            if self.is_writer:
                self._corrupt(step, error or f"another rank read a bad shard of step {step}")

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
        self._setup(state)
        if self.sharded:
            return self._save_sharded(step, state, reason)
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
        return self._settle(step, reason, edist.broadcast_int(outcome, self.control), error)

    def _save_sharded(self, step: int, state: tstate.TrainState, reason: str) -> bool:
        """Every rank writes its shards; rank 0 commits once all are durable. In the background,
        rank 0 learns that from the ranks' reports in storage; in the foreground (final,
        preemption), from one all-reduce of every rank's outcome."""
        epoch, capture = state.epoch_of(step), lambda: sharded.capture(state, step=step)
        if not (reason in MUST_COMMIT or not self.async_persist):
            self.writer.save(step, epoch, reason, capture, background=True)
            return True
        # A background commit of this very step may be in flight: settle it first, so nobody
        # rewrites files a committed manifest already lists.
        self.writer.wait()
        if edist.broadcast_int(int(self.writer.last_committed == step), self.control):
            self._last_committed = step
            return True
        local, error = self.writer.save(
            step, epoch, reason, capture, background=False, commit=False
        )
        outcome = edist.max_int(local, self.control)
        if outcome == COMMITTED and self.is_writer:
            outcome, error = self.writer.commit_pending()
        return self._settle(step, reason, edist.broadcast_int(outcome, self.control), error)

    def _settle(self, step: int, reason: str, outcome: int, error: BaseException | None) -> bool:
        """Every rank acts on the agreed outcome of a foreground save."""
        if outcome == FAILED:
            detail = f": {error}" if error else "; see rank 0's log for the storage error"
            raise CheckpointFailedError(
                f"the {reason} checkpoint at step {step} could not be committed{detail}"
            ) from error
        if outcome == COMMITTED:
            self._last_committed = step
            if self.writer and self.is_writer:
                self.writer.last_committed = step
        return outcome == COMMITTED

    @property
    def failure(self) -> Failure | None:
        """A background persist of this rank's that failed for good (the loop then stops every
        rank)."""
        return self.writer.failure if self.writer else None

    @property
    def skipped_step(self) -> int | None:
        """The newest step this rank gave up writing in the background (sharded)."""
        return self.writer.skipped_step if self.writer else None

    def abandon(self, step: int) -> None:
        """Some rank gave up on ``step``: rank 0 stops waiting for its shards."""
        if self.writer:
            self.writer.abandoned.add(step)

    def raise_failure(self) -> None:
        """Every rank, once the loop agreed that a background persist failed."""
        failure = self.failure
        if failure is None:
            raise CheckpointFailedError(
                "another rank's background checkpoint persist failed; see its log for the error"
            )
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

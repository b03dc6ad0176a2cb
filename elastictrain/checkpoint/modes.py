"""How a run's state is laid out on its tiers, decided once (:func:`mode_for`) from the model.

- :class:`Replicated` (DDP, one process): every rank holds the whole state. Rank 0 writes it as
  one flat file; every rank resumes from one copy, read once and broadcast; a node keeps one copy
  of it in memory (``tiers.local``).
- :class:`Sharded` (FSDP2): every rank holds its own shards. Every rank writes them and rank 0
  commits; every rank reads only the byte ranges of its new shards, at any world size; each rank
  keeps its shards and its buddy's in node memory (``tiers.shards``).

A mode supplies what differs (the layout, who writes, the node-memory tier, the save and the
fetch of a resume); :class:`~elastictrain.checkpoint.checkpointer.Checkpointer` keeps what is
common (the claim, the agreement on an outcome, the record). A new layout is a new mode.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

import storage
from elastictrain.checkpoint.api import Layout, Reason, Restored, ResumeOrigin, SaveOutcome, Tier
from elastictrain.checkpoint.resume import live as live_resume
from elastictrain.checkpoint.resume import live_shards, ranking, shard_fetch
from elastictrain.checkpoint.resume.durable_shards import fetch_durable_shards
from elastictrain.checkpoint.resume.live import Live
from elastictrain.checkpoint.sharded import format as sharded
from elastictrain.checkpoint.state import train_state as tstate
from elastictrain.checkpoint.tiers.local import LocalTier
from elastictrain.checkpoint.tiers.shards import ShardTier
from elastictrain.checkpoint.write.layouts import FlatLayout, ShardedLayout
from elastictrain.checkpoint.write.persist import Persister
from elastictrain.cluster.collectives import broadcast_int, max_int
from elastictrain.config import CheckpointConfig


class Checkpointer(Protocol):
    """What a mode uses of the checkpointer that drives it: the common half of the protocol."""

    config: CheckpointConfig
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    is_writer: bool
    group: dist.ProcessGroup | None
    store: storage.Store | None
    """The durable store (rank 0, and every rank that reads or writes shards), else None."""
    writer: Persister | None
    local: LocalTier | None

    @property
    def last_committed(self) -> int | None: ...

    def waits_for_commit(self, reason: Reason) -> bool: ...

    def agree_already_committed(self, step: int) -> bool: ...

    def settle(
        self, step: int, reason: Reason, outcome: int, error: BaseException | None
    ) -> bool: ...

    def report_corrupt(self, step: int, error: Exception | str, tier: Tier) -> None: ...


class Mode(Protocol):
    name: str
    every_rank_writes: bool
    """Every rank has a persister and the store (False: rank 0 alone writes)."""

    def layout(self, rank: int, world_size: int) -> Layout: ...

    def node_tier(self, ckpt: Checkpointer, **tier: Any) -> LocalTier: ...

    def fetch(
        self, ckpt: Checkpointer, state: tstate.TrainState, device: torch.device
    ) -> Restored | None:
        """Every rank together: the best copy on any tier, loaded into ``state``."""

    def fetch_live(
        self, ckpt: Checkpointer, state: tstate.TrainState, device: torch.device, live: Live
    ) -> Restored | None:
        """Every rank together, in an in-place epoch: the state from the survivors' memory."""

    def save(self, ckpt: Checkpointer, step: int, state: tstate.TrainState, reason: Reason) -> bool:
        """Every rank: checkpoint ``step``; False when it was skipped."""


def mode_for(model: torch.nn.Module) -> Mode:
    """The one place that decides: sharded parameters (DTensors) are saved by every rank."""
    return Sharded() if sharded.is_sharded(model) else Replicated()


class Replicated:
    name = "replicated"
    every_rank_writes = False

    def layout(self, rank: int, world_size: int) -> Layout:
        return FlatLayout()

    def node_tier(self, ckpt: Checkpointer, **tier: Any) -> LocalTier:
        return LocalTier(ckpt.config, **tier)

    def fetch(
        self, ckpt: Checkpointer, state: tstate.TrainState, device: torch.device
    ) -> Restored | None:
        copy = ranking.fetch_best(
            ckpt.store,
            ckpt.local,
            group=ckpt.group,
            rank=ckpt.rank,
            read_all=ckpt.config.resume_read == "all",
            on_corrupt=ckpt.report_corrupt,
        )
        if copy is None:
            return None
        payload = tstate.from_bytes(copy.data, map_location=device)
        tstate.check_compatible(state, payload, where=copy.where)
        tstate.restore(state, payload)
        nbytes = len(copy.data)
        origin = ResumeOrigin(
            copy.tier,
            remote_bytes=nbytes if copy.tier is Tier.DURABLE else 0,
            durable_step=copy.durable_step,
            source_rank=copy.source_rank,
        )
        return Restored(payload, copy.saved_world_size, nbytes, origin)

    def fetch_live(
        self, ckpt: Checkpointer, state: tstate.TrainState, device: torch.device, live: Live
    ) -> Restored | None:
        """The whole state of the survivor holding the newest step, sent to every rank."""
        return live_resume.fetch(
            live, state, device, ckpt.group, rank=ckpt.rank, world_size=ckpt.world_size
        )

    def save(self, ckpt: Checkpointer, step: int, state: tstate.TrainState, reason: Reason) -> bool:
        if not ckpt.waits_for_commit(reason):  # no collective: each rank may decide alone
            if ckpt.is_writer and ckpt.last_committed != step:
                ckpt.writer.save(
                    step,
                    state.epoch_of(step),
                    reason,
                    lambda: tstate.capture(state, step=step),
                    background=True,
                )
            return True
        # Only rank 0 knows whether it committed this step in the background: it decides for all,
        # or a rank that thinks otherwise waits for an outcome that is never broadcast.
        if ckpt.agree_already_committed(step):
            return True
        outcome, error = SaveOutcome.COMMITTED, None
        if ckpt.is_writer:
            outcome, error = ckpt.writer.save(
                step,
                state.epoch_of(step),
                reason,
                lambda: tstate.capture(state, step=step),
                background=False,
            )
        return ckpt.settle(step, reason, broadcast_int(outcome, ckpt.group), error)


class Sharded:
    name = "sharded"
    every_rank_writes = True

    def layout(self, rank: int, world_size: int) -> Layout:
        return ShardedLayout(rank, world_size)

    def node_tier(self, ckpt: Checkpointer, **tier: Any) -> LocalTier:
        return ShardTier(
            ckpt.config, local_world_size=ckpt.local_world_size, group=ckpt.group, **tier
        )

    def fetch(
        self, ckpt: Checkpointer, state: tstate.TrainState, device: torch.device
    ) -> Restored | None:
        """From the fast tier's copies when they hold a step at least as new as the durable
        tier's (``shard_fetch``), else from the durable tier."""
        where = dict(
            group=ckpt.group, rank=ckpt.rank, device=device, on_corrupt=ckpt.report_corrupt
        )
        tier_dir = ckpt.local.dir if ckpt.local is not None else None
        fast = shard_fetch.fetch_fast(
            state, tier_dir, ckpt.store, local_rank=ckpt.local_rank, **where
        )
        if fast is not None:
            tstate.restore(state, fast.payload, model_and_optimizer=False)
            return fast
        return fetch_durable_shards(state, ckpt.store, **where)

    def fetch_live(
        self, ckpt: Checkpointer, state: tstate.TrainState, device: torch.device, live: Live
    ) -> Restored | None:
        """Each rank's shards from a survivor holding them (its own; HSDP: a twin's), else every
        rank rolled back to the newest step the copies hold whole (:meth:`fetch`)."""
        restored = live_shards.fetch(live, state, ckpt.group, ckpt.rank)
        return restored if restored is not None else self.fetch(ckpt, state, device)

    def save(self, ckpt: Checkpointer, step: int, state: tstate.TrainState, reason: Reason) -> bool:
        """Every rank writes its shards; rank 0 commits once all are durable. In the background,
        rank 0 learns that from the ranks' reports in storage; in the foreground (final,
        preemption), from one all-reduce of every rank's outcome."""
        epoch, capture = state.epoch_of(step), lambda: sharded.capture(state, step=step)
        if not ckpt.waits_for_commit(reason):
            ckpt.writer.save(step, epoch, reason, capture, background=True)
            return True
        # A background commit of this very step may be in flight: settle it first, so nobody
        # rewrites files a committed manifest already lists.
        ckpt.writer.wait()
        if ckpt.agree_already_committed(step):
            return True
        local, error = ckpt.writer.save(
            step, epoch, reason, capture, background=False, commit=False
        )
        outcome = max_int(local, ckpt.group)
        if outcome == SaveOutcome.COMMITTED and ckpt.is_writer:
            outcome, error = ckpt.writer.commit_pending()
        return ckpt.settle(step, reason, broadcast_int(outcome, ckpt.group), error)

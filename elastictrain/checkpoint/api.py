"""The checkpoint package's contracts: the names every module and test shares, and the seams
between its parts.

- :class:`Tier`: where a checkpoint's bytes live. :class:`Reason`: why one was taken.
  :class:`SaveOutcome`: what became of a save, agreed over the ranks.
- :class:`ResumeOrigin`: where a resume's state came from, built once by the fetch that read it;
  :class:`Restored`: what every fetch returns, whatever the layout.
- :class:`Snap` and :class:`Layout`: what one rank writes for a checkpoint and how rank 0 commits
  it (``write.layouts``). The store they write to is ``storage.api.Store``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import storage
from elastictrain.observe.events import Name


class Tier(Name):
    """Where a checkpoint's bytes live (the ``tier`` of ``resume`` and ``checkpoint_corrupt``)."""

    DURABLE = "durable"  # the --checkpoint-dir location: survives the job
    LOCAL = "local"  # a node's copy of the replicated state, in node memory
    FAST = "fast"  # every rank's shards in its node's memory and on a buddy node
    LIVE = "live"  # a survivor's training memory, sent to a new epoch (--replace-in-place)


class Reason(Name):
    """Why a checkpoint was taken (the ``reason`` of checkpoint events)."""

    STEPS = "steps"  # every N steps
    TIME = "time"  # every T seconds, on rank 0's clock
    FINAL = "final"  # the end of training
    PREEMPT = "preempt"  # a stop signal (SIGTERM, Ctrl-C, ...)


MUST_COMMIT = (Reason.FINAL, Reason.PREEMPT)
"""Checkpoints the run cannot go on without: the end of training, and the one a preemption
waits for."""


class SaveOutcome(enum.IntEnum):
    """What became of one save, broadcast from rank 0 so every rank acts on the same one. Ordered
    from best to worst: the max over ranks is the outcome of a step every rank wrote."""

    COMMITTED = 0
    SKIPPED = 1
    FAILED = 2
    NON_FINITE = 3
    """A rank's copy held a NaN or an infinity: refused before any byte was written."""


Corrupt = Callable[[int, "Exception | str", Tier], None]
"""Rank 0 reports a copy that did not verify: (step, error, tier)."""


@dataclass(frozen=True)
class ResumeOrigin:
    """Where a resume's state came from: the ``resume`` event's account, and the report's."""

    tier: Tier
    remote_bytes: int
    """Bytes read from the durable tier (this rank's; 0 from node memory)."""
    durable_step: int | None = None
    """The durable tier's newest step: what a resume without node memory would have got."""
    source_rank: int | None = None
    """The rank that read the copy (fast tier: the first rank of the first node serving one)."""
    local_bytes: int = 0
    """Fast tier, job-wide: bytes read from each rank's own node's memory."""
    peer_bytes: int = 0
    """Fast tier, job-wide: bytes sent from another node's memory."""
    served_by: Mapping[str, list[int]] = field(default_factory=dict)
    """Fast tier: which saved ranks each node (named by its first rank) served. Live, sharded:
    which ranks each survivor sent its shards to (each rank's own are not listed)."""

    def committed_step(self, step: int) -> int | None:
        """The newest *durable* step once resumed at ``step``: a step read from node memory
        must still be written when a save comes at it, before the node's copies go."""
        return step if self.tier is Tier.DURABLE else self.durable_step

    def steps_saved(self, step: int) -> int:
        """Steps newer than the durable tier's newest (what node memory saved redoing)."""
        return step - (self.durable_step or 0)

    def event_fields(self, step: int) -> dict[str, Any]:
        """The ``resume`` event's fields for this origin (the same keys the timeline reads)."""
        fields: dict[str, Any] = {"tier": self.tier, "remote_bytes": self.remote_bytes}
        if self.source_rank is not None:
            fields["source_rank"] = self.source_rank
        if self.tier is not Tier.DURABLE or self.durable_step is not None:
            fields["durable_step"] = self.durable_step
        if self.tier is Tier.FAST:
            fields.update(
                local_bytes=self.local_bytes,
                peer_bytes=self.peer_bytes,
                served_by=dict(self.served_by),
            )
        elif self.served_by:  # live, sharded: which survivor sent which rank its shards
            fields["served_by"] = dict(self.served_by)
        if self.tier is not Tier.DURABLE:
            fields["steps_saved"] = self.steps_saved(step)
        return fields


@dataclass(frozen=True)
class Restored:
    """What a resume's fetch returns, whatever the layout: the state is already loaded."""

    payload: dict[str, Any]
    """The checkpoint's plain contents (progress, data position, ``extra``)."""
    saved_world_size: int | None
    nbytes: int
    """State bytes this rank read, from any tier."""
    origin: ResumeOrigin


class Snap(Protocol):
    """A layout's snapshot of one checkpoint, in host memory."""

    def wait(self) -> None:
        """Until the device-to-host copies have landed (CUDA); at once on the CPU."""

    def non_finite(self) -> list[str]:
        """The paths of the copy's tensors holding a NaN or an infinity (after :meth:`wait`)."""


@runtime_checkable
class Layout(Protocol):
    """What one rank puts on storage for a checkpoint, and how rank 0 commits it."""

    def snapshot(self, payload: Any) -> Snap:
        """Copy the captured state into reused host memory: the only part that blocks training."""

    def write_own(self, store: storage.Store, step: int, snap: Snap, generation: int) -> None:
        """This rank's files of ``step``, before the commit."""

    def commit(
        self,
        store: storage.Store,
        step: int,
        snap: Snap,
        generation: int,
        metadata: dict[str, Any],
        *,
        before_commit: Callable[[], None],
        abandoned: Callable[[int], bool],
        deadline_s: float,
        replace_older: bool = False,
    ) -> storage.Manifest:
        """Rank 0: the rest of the files, then the manifest, last. ``replace_older``: publish it
        over an older generation's (or a corrupt) manifest at this step
        (``storage.Store.commit_written``)."""

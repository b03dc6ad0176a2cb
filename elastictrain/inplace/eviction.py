"""Health decides who is in the job: a straggler's node evicted in place (``--straggler-action
evict``), or its ranks handed to a spare node (``replace``: ``inplace.spares``); a node whose
replica computed wrong the same way (``train.replicas``: evicted, or replaced where a spare
stands by), after the rollback that undid its fault.

Rank 0 names stragglers at its progress reports (``observe.stragglers.StragglerWatch``). Under
``evict`` it then decides here whether the straggler's node leaves (:class:`EvictionPolicy`), and
every rank learns the decision in one small broadcast at that report's step (:func:`agree`):

- the node's ranks exit 9 (``NodeEvictedError``). Each one's supervisor ends its spare and stops
  the node's torchrun agent with SIGTERM (``inplace.supervisor``): an agent that exits on its own
  closes the job's rendezvous for good (no later restart could re-form the group), and one whose
  workers fail restarts them, which re-forms every node's group;
- the other ranks leave the epoch at the same step with their state, the evicted ranks counted
  as silent (not waited for), and regroup without them: the path of a lost node
  (``inplace.members``), in their own processes, torchrun restarting nothing.

A spare node standing by takes the evicted node's ranks (the lost-node path does that), so the
job keeps its size; ``replace`` is refused when none stands by. Budgets: never below
``--min-nodes`` training nodes, at most ``--max-evictions-per-hour`` evictions,
counted in the job's store (it outlives every process, so a new rank 0 reads the same count).
Every decision is an ``eviction`` event with the evidence it was made on, a refused one too. A
refused straggler is decided again at each report while it stays slow (a spare may come up, the
hour's budget free up); its refusal is recorded once while the reason holds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from elastictrain.observe.events import Event

if TYPE_CHECKING:
    import torch.distributed as dist

    from elastictrain.observe.events import EventLog

logger = logging.getLogger(__name__)

_HOUR_S = 3600.0


def history_key(run_id: str) -> str:
    """Where the job's store keeps the evictions' times (wall clock, comma-separated)."""
    return f"elastictrain/{run_id}/evictions"


class Candidate(Protocol):
    """A rank whose node may be evicted: a straggler (``observe.stragglers.Straggler``) or a
    replica that computed wrong (``train.replicas.Suspect``)."""

    rank: int

    def as_event(self) -> dict: ...

    def cause(self) -> str | None:
        """Why its node leaves ("is a straggler: ..."); None: not a cause (it recovered)."""


@dataclass(frozen=True)
class Eviction:
    """A node leaving the job: its ranks, by torchrun rank, and why."""

    node: int
    ranks: list[int]
    hosts: list[str]
    step: int
    evidence: dict[str, Any]
    """What it was judged on (``Candidate.as_event``: a straggler's ratio, a suspect's step)."""
    cause: str
    """``Candidate.cause``: "is a straggler: ...", "computed wrong: ..."."""
    action: str = "evict"
    """``--straggler-action``: ``replace`` was decided only with a spare node standing by."""
    spares: int = 0
    """Spare nodes standing by when it was decided: one takes the node's ranks."""
    decided_by: str = "--straggler-action"

    def describe(self) -> str:
        after = "a spare node takes its ranks" if self.spares else "the others go on without it"
        return (
            f"node {self.node} (ranks {self.ranks}, host {', '.join(sorted(set(self.hosts)))}) "
            f"{self.cause}; evicted at step {self.step} ({self.decided_by} {self.action}), "
            f"{after}"
        )


class EvictionPolicy:
    """Rank 0's decision: whether a named straggler's node leaves, within the budgets."""

    def __init__(
        self,
        *,
        min_nodes: int,
        per_hour: int,
        store: dist.Store | None,
        run_id: str,
        action: str = "evict",
        spares: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``store``: the job's (the evictions' history); None keeps it in this process only.
        ``action``: ``evict`` or ``replace`` (refused without a spare: it never shrinks the job);
        ``spares``: the spare nodes standing by now (``inplace.spares``)."""
        self.min_nodes, self.per_hour = min_nodes, per_hour
        self.action, self.spares = action, spares
        self._store, self._key, self._clock = store, history_key(run_id), clock
        self._local: list[float] = []

    def decide(
        self,
        named: list[Candidate],
        *,
        step: int,
        members: list[int],
        nodes: list[int],
        hosts: list[str],
        events: EventLog,
        movable: bool = True,
        store_nodes: list[int] = (),
        said: dict[int, str] | None = None,
        decided_by: str = "--straggler-action",
    ) -> Eviction | None:
        """``named``: the stragglers standing (named slow and not recovered: a refusal is
        decided again at each report, since a spare, or the hour's budget, may free up), or the
        replicas that computed wrong (``decided_by``: what named them, for the message);
        ``members``, ``nodes``, ``hosts``: the epoch's, by its rank (torchrun rank, node, host).
        ``movable``: the state can move in place (a stream's per-rank position cannot).
        ``store_nodes``: the nodes serving the job's store, never evicted. Each refusal and the
        eviction are recorded in ``events``; ``said``: each rank's last refusal, not recorded
        again while its reason stays the same (updated here)."""
        said = {} if said is None else said
        for candidate in named:
            cause = candidate.cause()
            if cause is None:
                continue
            node = nodes[candidate.rank]
            on_node = [r for r, n in enumerate(nodes) if n == node]
            eviction = Eviction(
                node=node,
                ranks=[members[r] for r in on_node],
                hosts=[hosts[r] for r in on_node],
                step=step,
                evidence=candidate.as_event(),
                cause=cause,
                action=self.action,
                spares=self.spares,
                decided_by=decided_by,
            )
            refused = self._refusal(nodes, movable, node in store_nodes)
            fields = {**asdict(eviction), "evicted": refused is None}
            if refused is not None:
                if said.get(candidate.rank) != refused:
                    logger.warning(
                        "not evicting node %d (rank %d): %s", node, candidate.rank, refused
                    )
                    events.emit(Event.EVICTION, **fields, refused=refused)
                    said[candidate.rank] = refused
                continue
            self._record()
            logger.error("EVICTED: %s", eviction.describe())
            events.emit(Event.EVICTION, **fields)
            return eviction
        return None

    def _refusal(self, nodes: list[int], movable: bool, serves_store: bool) -> str | None:
        if not movable:
            return "the data stream's per-rank positions cannot move in place"
        if serves_store:
            return (
                "its torchrun agent serves the job's rendezvous store, which every other node "
                "needs to go on (put --rdzv-endpoint off the training nodes: docs/faults.md)"
            )
        if self.action == "replace" and not self.spares:
            return (
                "no spare node stands by, and --straggler-action replace never shrinks the job "
                "(--straggler-action evict would)"
            )
        left = len(set(nodes)) - (0 if self.spares else 1)
        if left < self.min_nodes:
            return f"it would leave {left} node(s), below --min-nodes {self.min_nodes}"
        recent = self._recent()
        if len(recent) >= self.per_hour:
            return (
                f"{len(recent)} eviction(s) in the last hour already "
                f"(--max-evictions-per-hour {self.per_hour})"
            )
        return None

    def _recent(self) -> list[float]:
        now = self._clock()
        if self._store is None:
            times = self._local
        elif self._store.check([self._key]):
            raw = bytes(self._store.get(self._key)).decode()
            times = [float(t) for t in raw.split(",") if t]
        else:
            times = []
        return [t for t in times if now - t < _HOUR_S]

    def _record(self) -> None:
        now = self._clock()
        if self._store is None:
            self._local.append(now)
        else:
            self._store.append(self._key, f"{now:.3f},")


def agree(
    policy: EvictionPolicy | None, decide: Callable[[EvictionPolicy], Eviction | None], group: Any
) -> Eviction | None:
    """Every rank, at the same report: rank 0's decision (``decide(policy)``; ``policy`` is rank
    0's when it named a straggler, None otherwise: no decision), broadcast over ``group``: one
    small object every --log-every-seconds, and only under ``evict``."""
    import torch.distributed as dist

    box = [decide(policy) if policy is not None else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]

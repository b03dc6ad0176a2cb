"""Silent data corruption, caught by comparing replicas (``--compare-replicas-every K``).

Data-parallel replicas hold bitwise-identical parameters after every step: DDP's ranks, and
HSDP's twins (the ranks that hold the same shards in different replicas). A device that computes
wrong without failing (a flipped bit in memory, a bad multiply) breaks that. So every K steps,
after the optimizer step, each rank digests its parameters (8 bytes), every rank learns every
digest in one small all-gather, and all judge them alike:

- all twins agree: this step is the newest agreed one;
- some differ: every rank rolls back to the newest copy at or before the last agreed step
  (``train.rollback``), skipping nothing (the data is not at fault), and trains the steps again:
  a fault that passed (a flipped bit) is gone, and the replay is bitwise the run it should have
  been. With three or more twins, the ones outside a strict majority are the suspects, named in
  the event, and under ``--replace-in-place`` their nodes leave the job after the rollback
  (``train.health``: a spare node standing by takes their ranks). Where a suspect's node cannot
  leave, the same rank a suspect twice stops the job (exit 10) naming its host.
- two twins have no majority, and a replay cannot name one either: the flipped replica's wrong
  values reach every replica's gradient at the next all-reduce, so both first tries differ from
  the replay. After the rollback every node runs its exact compute check (``cluster.self_check``)
  and a node whose device computes wrong now fails it and leaves; a fault that passed (one flip)
  leaves no trace to name, and a mismatch that comes back after the replay stops the job (the
  rollback's rule).

FSDP without replicas has no twin to compare with: the check is off there, and says so once.
Buffers are not compared: DDP broadcasts them before each forward, and the forward updates them
from each rank's own batch.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import torch
import xxhash
from torch import nn

from elastictrain.cluster.collectives import all_gather_object
from elastictrain.errors import NumericalFaultError
from elastictrain.mesh import MeshShape
from elastictrain.observe.events import Event, EventLog

logger = logging.getLogger(__name__)

DIFFER = "replicas differ"


def digest(model: nn.Module) -> int:
    """64 bits that any flipped bit of this rank's parameters (its shards) changes. On the CPU
    xxh3 over the bytes; on a GPU each tensor's sum of its words as integers, on the device (a
    single flip moves it by a power of two), then 8 bytes to the host."""
    tensors = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    if any(t.is_cuda for t in tensors):
        sums = [_word_sum(t) for t in tensors]
        by_device: dict[torch.device, list[int]] = {}  # one host copy per device
        for i, s in enumerate(sums):
            by_device.setdefault(s.device, []).append(i)
        total = [0] * len(sums)
        for indices in by_device.values():
            for i, v in zip(indices, torch.stack([sums[i] for i in indices]).tolist(), strict=True):
                total[i] = v
        return sum((i + 1) * v for i, v in enumerate(total)) % (1 << 64)
    h = xxhash.xxh3_64()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy())
    return h.intdigest()


def _word_sum(t: torch.Tensor) -> torch.Tensor:
    words = {8: torch.int64, 4: torch.int32, 2: torch.int16}.get(t.element_size(), torch.uint8)
    return t.detach().contiguous().view(words).sum(dtype=torch.int64)


def twin_key(shape: MeshShape | None, rank: int) -> int | None:
    """Ranks with the same key must hold the same parameters: every rank under DDP (None: the
    shape of a run without a mesh), the same shard and tensor-parallel position under HSDP."""
    if shape is None:
        return 0
    return rank % (shape.dp_shard * shape.tp)


@dataclass(frozen=True)
class Suspect:
    """A rank whose parameters differed from a strict majority of its twins: the evidence its
    node is evicted on (``train.health``, ``inplace.eviction``)."""

    rank: int
    host: str
    step: int
    agreed_at: int
    twins: int
    """How many ranks hold the same parameters as it should (itself included)."""

    def as_event(self) -> dict:
        return asdict(self)

    def cause(self) -> str:
        return (
            f"computed wrong: rank {self.rank}'s parameters differed from a strict majority of "
            f"its {self.twins} twins at step {self.step} (all agreed at step {self.agreed_at})"
        )


@dataclass(frozen=True)
class Mismatch:
    step: int
    agreed_at: int
    """The newest step every group of twins agreed at: the rollback's bound."""
    suspects: list[Suspect]
    """Ranks outside a strict majority of their twins (empty: no majority; the nodes' exact
    compute check decides, ``train.health``)."""


class ReplicaCheck:
    """Every rank: the digests compared every ``every`` steps (None: off)."""

    def __init__(
        self,
        every: int | None,
        *,
        shape: MeshShape | None,
        rank: int,
        world_size: int,
        group: Any,
        events: EventLog,
        host: str,
        start: int,
    ) -> None:
        twins = world_size // (shape.dp_shard * shape.tp) if shape is not None else world_size
        self.every = every if twins >= 2 else None
        if every and twins < 2 and rank == 0:
            logger.info(
                "replicas not compared: the parameters have no twin (FSDP without replicas, or "
                "one data-parallel rank); a state that went non-finite is still never committed"
            )
        self.key, self.rank, self.group, self.events, self.host = (
            twin_key(shape, rank),
            rank,
            group,
            events,
            host,
        )
        self.agreed_at = start
        self._suspected: set[int] = set()

    def due(self, done: int) -> bool:
        return bool(self.every) and done % self.every == 0

    def compare(self, done: int, model: nn.Module) -> Mismatch | None:
        """Every rank at a due step; the mismatch every rank sees, or None."""
        every = all_gather_object((self.rank, self.key, digest(model), self.host), self.group)
        groups: dict[int, list[tuple[int, int]]] = {}
        for rank, key, d, _ in every:
            groups.setdefault(key, []).append((rank, d))
        differing = [g for g in groups.values() if len({d for _, d in g}) > 1]
        if not differing:
            self.agreed_at = done
            return None
        ranks = sorted(r for g in differing for r in _outside_majority(g))
        hosts = {rank: host for rank, _, _, host in every}
        twins = {r: len(g) for g in differing for r, _ in g}
        suspects = [Suspect(r, hosts[r], done, self.agreed_at, twins[r]) for r in ranks]
        self.events.emit(
            Event.REPLICAS,
            step=done,
            agreed_at=self.agreed_at,
            suspects=ranks,
            digests={str(r): f"{d:016x}" for g in differing for r, d in g},
        )
        if self.rank == 0:
            logger.error(
                "REPLICAS DIFFER at step %d: twins hold different parameters (suspect rank(s) "
                "%s; %s); rolling back to the newest copy at or before step %d, where they agreed",
                done,
                ranks or "unknown",
                "a strict majority agreed"
                if ranks
                else "no majority: the nodes' compute check decides",
                self.agreed_at,
            )
        again = [r for r in ranks if r in self._suspected]
        self._suspected.update(ranks)
        if again:  # its device keeps computing wrong, and its node could not be evicted
            raise NumericalFaultError(
                f"{', '.join(f'rank {r} on {hosts[r]}' for r in again)} computed wrong a second "
                f"time (at step {done}, outside a strict majority of its twins): its device "
                "corrupts data silently. Nothing computed after the last agreed step "
                f"({self.agreed_at}) is kept. Drain that node and relaunch without it."
            )
        return Mismatch(done, self.agreed_at, suspects)


def _outside_majority(group: list[tuple[int, int]]) -> list[int]:
    """The ranks whose digest is not a strict majority's (none without one)."""
    value, count = Counter(d for _, d in group).most_common(1)[0]
    if count * 2 <= len(group):
        return []
    return [r for r, d in group if d != value]


@torch.no_grad()
def flip_a_bit(model: nn.Module) -> None:
    """One bit of the first parameter's first element, a quarter into its word (float32: bit 8
    of the mantissa): a silent corruption that keeps the value finite (``chaos --fault
    bitflip``)."""
    first = next(p for p in model.parameters())
    local = first.to_local() if hasattr(first, "to_local") else first
    size = local.element_size()
    words = {8: torch.int64, 4: torch.int32, 2: torch.int16}[size]
    local.view(-1)[:1].view(words).bitwise_xor_(1 << (2 * size))

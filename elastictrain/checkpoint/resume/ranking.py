"""Resume from the best copy on any tier: the newest step that verifies, the ranks agreeing.

Every rank learns every offer in one ``all_gather_object``: rank 0 lists the durable tier's
manifests (and its fence), each node's local rank 0 its local copies. All ranks then walk the same
ranked list, so they agree without further talk: newest (generation, step) first, and at equal
steps a local copy before the durable one (RAM, not the network). The rank holding the chosen copy
reads and verifies it, says whether it verified, and broadcasts its bytes: a node whose own copy
is older, or that has none (it replaced a lost node), gets the state from a peer over the
process group, not from remote storage. A copy that does not verify is reported like any corrupt
checkpoint (``CORRUPT CHECKPOINT``, ``checkpoint_corrupt``) and the next one is tried.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

import storage
from elastictrain.checkpoint.api import Corrupt, Tier
from elastictrain.checkpoint.sharded import reader as shard_reader
from elastictrain.checkpoint.sharded.format import is_sharded_checkpoint as is_sharded
from elastictrain.checkpoint.state import train_state as tstate
from elastictrain.checkpoint.tiers.local import LocalTier
from elastictrain.cluster.collectives import all_gather_object, broadcast_bytes, broadcast_int

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    generation: int
    step: int
    saved_world_size: int | None
    tier: Tier
    rank: int
    """The rank that reads it: rank 0 for the durable tier, a node's local rank 0 for its copy."""
    sharded: bool = False
    """Saved sharded: its reader consolidates it (no rank reads one state file of it)."""

    def rank_key(self) -> tuple[int, int, int, int]:
        return (self.generation, self.step, int(self.tier is Tier.LOCAL), -self.rank)


@dataclass(frozen=True)
class Found:
    data: bytes | bytearray | memoryview
    where: str
    tier: Tier
    source_rank: int
    saved_world_size: int | None
    durable_step: int | None
    """The newest committed durable step (what a resume without the local tier would get)."""


def candidates(offers: list[dict]) -> list[Candidate]:
    """Every rank's offers, ranked best first (the same list on every rank)."""
    fence = offers[0]["fence"]
    found = [Candidate(g, s, w, Tier.DURABLE, 0, sh) for g, s, w, sh in offers[0]["durable"]]
    for rank, offer in enumerate(offers):
        found += [
            Candidate(g, s, w, Tier.LOCAL, rank) for g, s, w in offer["local"] if 0 < g <= fence
        ]
    return sorted(found, key=Candidate.rank_key, reverse=True)


def logged(on_corrupt: Corrupt) -> Callable[[int, Exception | str], None]:
    def report(step: int, error: Exception | str) -> None:
        logger.error("CORRUPT CHECKPOINT skipped, falling back to an older one: %s", error)
        on_corrupt(step, error, Tier.DURABLE)

    return report


def durable_listing(
    store: storage.Store | None,
    *,
    group: dist.ProcessGroup | None,
    rank: int,
    on_corrupt: Corrupt,
) -> list[storage.Manifest]:
    """Rank 0's ranked durable manifests (empty elsewhere). A checkpoint in a newer format stops
    every rank with the same error before anything is read or claimed: skipping it as corrupt
    would let this older version overwrite or delete it."""
    listed, refusal = [], None
    if rank == 0:
        try:
            listed = store.ranked_manifests(on_corrupt=logged(on_corrupt))
        except storage.NewerFormatError as e:
            refusal = str(e).encode()
    refusal = broadcast_bytes(refusal, group)
    if refusal:
        raise storage.NewerFormatError(bytes(refusal).decode())
    return listed


def fetch_best(
    durable: storage.Store | None,
    local: LocalTier | None,
    *,
    group: dist.ProcessGroup | None,
    rank: int,
    read_all: bool,
    on_corrupt: Corrupt,
) -> Found | None:
    """The chosen checkpoint's state bytes on every rank, or None when no tier holds one.
    ``durable``: the store on rank 0 (and on every rank with ``read_all``), else None."""
    listed = durable_listing(durable, group=group, rank=rank, on_corrupt=on_corrupt)
    fence = durable.read_fence() if rank == 0 else 0
    mine = {
        "fence": fence,
        "durable": [
            (m.generation, m.step, m.metadata.get("world_size"), is_sharded(m.metadata))
            for m in listed
        ],
        "local": local.offers() if local is not None else [],
    }
    ranked = candidates(all_gather_object(mine, group))
    newest_durable = max((c.step for c in ranked if c.tier is Tier.DURABLE), default=None)
    for c in ranked:
        data, why = _read_on_holder(durable, local, c) if rank == c.rank else (None, "")
        if not broadcast_int(int(data is not None), group, src=c.rank):
            if rank == c.rank:
                logger.error("CORRUPT CHECKPOINT (%s tier) skipped: %s", c.tier, why)
            if rank == 0:
                on_corrupt(c.step, why or f"rank {c.rank}'s copy did not verify", c.tier)
            continue
        where = f"step {c.step} ({c.tier} tier, read by rank {c.rank})"
        if c.tier is Tier.DURABLE and read_all and not c.sharded:
            if rank != 0:
                read = durable.read(c.step)
                data = read.files[tstate.state_file_of(read.manifest.metadata)]
        else:
            data = broadcast_bytes(data if rank == c.rank else None, group, src=c.rank)
        return Found(data, where, c.tier, c.rank, c.saved_world_size, newest_durable)
    return None


def _read_on_holder(
    durable: storage.Store | None, local: LocalTier | None, c: Candidate
) -> tuple[bytes | memoryview | None, str]:
    """On the rank that holds candidate ``c``: its verified bytes, else (None, why)."""
    store = local.store if c.tier is Tier.LOCAL else durable
    try:
        if c.sharded:
            # Saved sharded (FSDP, HSDP, tensor parallel), resumed replicated (DDP): this rank
            # consolidates the whole state, every byte verified, once for every rank.
            manifest = store.read_manifest(c.step)
            return tstate.to_bytes(shard_reader.consolidate(store, manifest)), ""
        read = store.read(c.step)
    except storage.StorageError as e:
        return None, str(e)
    return read.files[tstate.state_file_of(read.manifest.metadata)], ""

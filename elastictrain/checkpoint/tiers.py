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
from dataclasses import dataclass

import storage
from elastictrain import dist as edist
from elastictrain.checkpoint import state as tstate
from elastictrain.checkpoint.local_tier import LocalTier

logger = logging.getLogger(__name__)

LOCAL, DURABLE = "local", "durable"


@dataclass(frozen=True)
class Candidate:
    generation: int
    step: int
    saved_world_size: int | None
    tier: str
    rank: int
    """The rank that reads it: rank 0 for the durable tier, a node's local rank 0 for its copy."""

    def rank_key(self) -> tuple[int, int, int, int]:
        return (self.generation, self.step, int(self.tier == LOCAL), -self.rank)


@dataclass(frozen=True)
class Found:
    data: bytes | bytearray | memoryview
    where: str
    tier: str
    source_rank: int
    saved_world_size: int | None
    durable_step: int | None
    """The newest committed durable step (what a resume without the local tier would get)."""


def candidates(offers: list[dict]) -> list[Candidate]:
    """Every rank's offers, ranked best first (the same list on every rank)."""
    fence = offers[0]["fence"]
    found = [Candidate(g, s, w, DURABLE, 0) for g, s, w in offers[0]["durable"]]
    for rank, offer in enumerate(offers):
        found += [Candidate(g, s, w, LOCAL, rank) for g, s, w in offer["local"] if 0 < g <= fence]
    return sorted(found, key=Candidate.rank_key, reverse=True)


def fetch_best(ckpt, local: LocalTier | None) -> Found | None:
    """The chosen checkpoint's state bytes on every rank, or None when no tier holds one.
    ``ckpt``: the :class:`Checkpointer` (its store, group, rank, read mode, corrupt reporting)."""
    group, rank = ckpt.control, ckpt.rank
    durable: list[storage.Manifest] = []
    fence = 0
    if ckpt.is_writer:
        durable = ckpt.store.ranked_manifests(on_corrupt=ckpt._corrupt)
        fence = ckpt.store.read_fence()
    mine = {
        "fence": fence,
        "durable": [(m.generation, m.step, m.metadata.get("world_size")) for m in durable],
        "local": local.offers() if local is not None else [],
    }
    offers = edist.all_gather_object(mine, group)
    ranked = candidates(offers)
    newest_durable = max((c.step for c in ranked if c.tier == DURABLE), default=None)
    for c in ranked:
        data, why = _read_on_holder(ckpt, local, c)
        ok = edist.broadcast_int(int(data is not None), group, src=c.rank)
        if not ok:
            if rank == c.rank:
                logger.error("CORRUPT CHECKPOINT (%s tier) skipped: %s", c.tier, why)
            if ckpt.is_writer:
                ckpt.report_corrupt(c.step, why or f"rank {c.rank}'s copy did not verify", c.tier)
            continue
        where = f"step {c.step} ({c.tier} tier, read by rank {c.rank})"
        if c.tier == DURABLE and ckpt.read_mode == "all":
            if not ckpt.is_writer:
                read = ckpt.store.read(c.step)
                data = read.files[tstate.state_file_of(read.manifest.metadata)]
        else:
            data = edist.broadcast_bytes(data if rank == c.rank else None, group, src=c.rank)
        return Found(data, where, c.tier, c.rank, c.saved_world_size, newest_durable)
    return None


def _read_on_holder(ckpt, local, c: Candidate) -> tuple[bytes | memoryview | None, str]:
    """On the rank that holds candidate ``c``: its verified bytes, else (None, why)."""
    if ckpt.rank != c.rank:
        return None, ""
    store = local.store if c.tier == LOCAL else ckpt.store
    try:
        read = store.read(c.step)
    except storage.StorageError as e:
        return None, str(e)
    return read.files[tstate.state_file_of(read.manifest.metadata)], ""

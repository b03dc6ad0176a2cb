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

import torch
import torch.distributed as dist

import storage
from elastictrain import dist as edist
from elastictrain.checkpoint.resume import shard_fetch as shard_fetch
from elastictrain.checkpoint.sharded import reader as shard_reader
from elastictrain.checkpoint.state import train_state as tstate
from elastictrain.checkpoint.tiers.local import LocalTier
from elastictrain.observe.events import Event, EventLog

logger = logging.getLogger(__name__)

LOCAL, DURABLE, FAST = "local", "durable", shard_fetch.FAST


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


Corrupt = Callable[[int, "Exception | str", str], None]
"""Rank 0 reports a copy that did not verify: (step, error, tier)."""


def _logged(on_corrupt: Corrupt) -> Callable[[int, Exception | str], None]:
    def report(step: int, error: Exception | str) -> None:
        logger.error("CORRUPT CHECKPOINT skipped, falling back to an older one: %s", error)
        on_corrupt(step, error, DURABLE)

    return report


def _durable_listing(
    store: storage.CheckpointStore | None,
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
            listed = store.ranked_manifests(on_corrupt=_logged(on_corrupt))
        except storage.NewerFormatError as e:
            refusal = str(e).encode()
    refusal = edist.broadcast_bytes(refusal, group)
    if refusal:
        raise storage.NewerFormatError(bytes(refusal).decode())
    return listed


def fetch_best(
    durable: storage.CheckpointStore | None,
    local: LocalTier | None,
    *,
    group: dist.ProcessGroup | None,
    rank: int,
    read_all: bool,
    on_corrupt: Corrupt,
) -> Found | None:
    """The chosen checkpoint's state bytes on every rank, or None when no tier holds one.
    ``durable``: the store on rank 0 (and on every rank with ``read_all``), else None."""
    listed = _durable_listing(durable, group=group, rank=rank, on_corrupt=on_corrupt)
    fence = durable.read_fence() if rank == 0 else 0
    mine = {
        "fence": fence,
        "durable": [(m.generation, m.step, m.metadata.get("world_size")) for m in listed],
        "local": local.offers() if local is not None else [],
    }
    ranked = candidates(edist.all_gather_object(mine, group))
    newest_durable = max((c.step for c in ranked if c.tier == DURABLE), default=None)
    for c in ranked:
        data, why = _read_on_holder(durable, local, c) if rank == c.rank else (None, "")
        if not edist.broadcast_int(int(data is not None), group, src=c.rank):
            if rank == c.rank:
                logger.error("CORRUPT CHECKPOINT (%s tier) skipped: %s", c.tier, why)
            if rank == 0:
                on_corrupt(c.step, why or f"rank {c.rank}'s copy did not verify", c.tier)
            continue
        where = f"step {c.step} ({c.tier} tier, read by rank {c.rank})"
        if c.tier == DURABLE and read_all:
            if rank != 0:
                read = durable.read(c.step)
                data = read.files[tstate.state_file_of(read.manifest.metadata)]
        else:
            data = edist.broadcast_bytes(data if rank == c.rank else None, group, src=c.rank)
        return Found(data, where, c.tier, c.rank, c.saved_world_size, newest_durable)
    return None


def _read_on_holder(
    durable: storage.CheckpointStore | None, local: LocalTier | None, c: Candidate
) -> tuple[bytes | memoryview | None, str]:
    """On the rank that holds candidate ``c``: its verified bytes, else (None, why)."""
    store = local.store if c.tier == LOCAL else durable
    try:
        read = store.read(c.step)
    except storage.StorageError as e:
        return None, str(e)
    return read.files[tstate.state_file_of(read.manifest.metadata)], ""


def fetch_sharded(
    state: tstate.TrainState,
    store: storage.CheckpointStore,
    *,
    group: dist.ProcessGroup | None,
    rank: int,
    device: torch.device,
    on_corrupt: Corrupt,
) -> tuple[dict, storage.Manifest, int] | None:
    """Sharded state, every rank together: the newest durable step whose files all exist at their
    recorded sizes and whose every byte range some rank reads verifies, loaded into ``state``.
    Rank 0 proposes, all read, all agree; a bad step (any rank) makes everyone fall back to the
    next older one. (payload, manifest, bytes read), or None when there is none."""
    corrupt = _logged(on_corrupt)
    candidates = iter(_durable_listing(store, group=group, rank=rank, on_corrupt=on_corrupt))
    touched = False
    while True:
        step = -1
        for manifest in candidates:
            try:
                store.check_sizes(manifest)
                step = manifest.step
                break
            except storage.CheckpointCorruptError as e:
                corrupt(manifest.step, e)
        step = edist.broadcast_int(step, group)
        if step < 0:
            if touched:
                raise storage.CheckpointCorruptError(
                    f"No sharded checkpoint under {store.safe_url!r} verified, and the failed "
                    "attempts overwrote part of this process's state; refusing to train from it. "
                    "Move the checkpoints aside to start fresh."
                )
            return None
        manifest = store.read_manifest(step)
        error = None
        try:
            payload, nbytes = shard_reader.load_into(state, store, manifest, device)
        except storage.CheckpointCorruptError as e:
            error = e
        touched = True
        if edist.max_int(int(error is not None), group) == 0:
            tstate.restore(state, payload, model_and_optimizer=False)
            return payload, manifest, nbytes
        if error is not None:
            logger.error("CORRUPT CHECKPOINT: rank %d read a bad shard: %s", rank, error)
        if rank == 0:
            corrupt(step, error or f"another rank read a bad shard of step {step}")


def fetch_sharded_best(
    state: tstate.TrainState,
    store: storage.CheckpointStore | None,
    tier_dir: str | None,
    *,
    group: dist.ProcessGroup | None,
    rank: int,
    local_rank: int,
    device: torch.device,
    on_corrupt: Corrupt,
) -> tuple[dict, int | None, int, dict] | None:
    """Sharded state from the fast tier's copies when they hold a step at least as new as the
    durable tier's (``shard_fetch``), else from the durable tier: (payload, saved world size,
    bytes this rank read, where they came from), or None when neither holds one."""
    fast = shard_fetch.fetch_fast(
        state,
        tier_dir,
        store,
        group=group,
        rank=rank,
        local_rank=local_rank,
        device=device,
        on_corrupt=on_corrupt,
    )
    if fast is not None:
        payload, saved_world, origin = fast
        tstate.restore(state, payload, model_and_optimizer=False)
        return payload, saved_world, origin.pop("rank_bytes"), origin
    found = fetch_sharded(
        state, store, group=group, rank=rank, device=device, on_corrupt=on_corrupt
    )
    if found is None:
        return None
    payload, manifest, nbytes = found
    origin = {"tier": DURABLE, "remote_bytes": nbytes}
    return payload, manifest.metadata.get("world_size"), nbytes, origin


def report_resume(
    events: EventLog,
    *,
    step: int,
    nbytes: int,
    seconds: float,
    saved_world: int | None,
    world_size: int,
    generation: int,
    is_writer: bool,
    origin: dict,
) -> None:
    """Say where the resume's state came from: one INFO line, the ``resume`` event, and on a
    change of world size the ``membership`` event."""
    if origin["tier"] == FAST:
        origin["steps_saved"] = step - (origin["durable_step"] or 0)
        logger.info(
            "resumed from the fast tier's copies of step %d (%d bytes from node memory, %d "
            "from other nodes, 0 from the durable tier; %.2fs; %d steps newer than its)",
            step,
            origin["local_bytes"],
            origin["peer_bytes"],
            seconds,
            origin["steps_saved"],
        )
    elif origin["tier"] == LOCAL:
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
    events.emit(
        Event.RESUME,
        fresh=False,
        step=step,
        bytes=nbytes,
        seconds=round(seconds, 4),
        world_size=world_size,
        saved_world_size=saved_world,
        generation=generation,
        **origin,
    )
    if is_writer and saved_world is not None and saved_world != world_size:
        logger.warning(
            "membership change: world size %s -> %d, resuming from step %d; the global batch "
            "stays the same, per-rank shares change",
            saved_world,
            world_size,
            step,
        )
        events.emit(
            Event.MEMBERSHIP,
            old_world_size=saved_world,
            new_world_size=world_size,
            step=step,
        )

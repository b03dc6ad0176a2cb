"""Sharded state from the durable tier, every rank together: the newest step whose files all
exist at their recorded sizes and whose every byte range some rank reads verifies."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

import storage
from elastictrain.checkpoint.api import Corrupt, Restored, ResumeOrigin, Tier
from elastictrain.checkpoint.resume import shared_reads
from elastictrain.checkpoint.resume.ranking import durable_listing, logged
from elastictrain.checkpoint.sharded import format as sharded
from elastictrain.checkpoint.sharded import load as shard_load
from elastictrain.checkpoint.state import train_state as tstate
from elastictrain.cluster.collectives import broadcast_int, max_int

logger = logging.getLogger(__name__)


def fetch_durable_shards(
    state: tstate.TrainState,
    store: storage.Store,
    *,
    group: dist.ProcessGroup | None,
    rank: int,
    device: torch.device,
    on_corrupt: Corrupt,
) -> Restored | None:
    """Sharded state, every rank together: the newest durable step whose files all exist at their
    recorded sizes and whose every byte range some rank reads verifies, loaded into ``state``.
    Rank 0 proposes, all read, all agree; a bad step (any rank) makes everyone fall back to the
    next older one. None when there is none."""
    corrupt = logged(on_corrupt)
    candidates = iter(durable_listing(store, group=group, rank=rank, on_corrupt=on_corrupt))
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
        step = broadcast_int(step, group)
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
            payload, nbytes = load_step(state, store, manifest, device, group=group, rank=rank)
        except storage.CheckpointCorruptError as e:
            error = e
        touched = True
        if max_int(int(error is not None), group) == 0:
            tstate.restore(state, payload, model_and_optimizer=False)
            origin = ResumeOrigin(Tier.DURABLE, remote_bytes=nbytes)
            return Restored(payload, manifest.metadata.get("world_size"), nbytes, origin)
        if error is not None:
            logger.error("CORRUPT CHECKPOINT: rank %d read a bad shard: %s", rank, error)
        if rank == 0:
            corrupt(step, error or f"another rank read a bad shard of step {step}")


def load_step(state, store, manifest, device, *, group, rank) -> tuple[dict, int]:
    """One step into ``state``: (the payload, bytes this rank read). Ranks that need the same
    bytes (HSDP's replicas) each read a share of them (``shared_reads``); every rank reaches that
    exchange, whatever its planning did, so none waits on a rank that left."""
    if not sharded.is_sharded_checkpoint(manifest.metadata):
        return shard_load.load_into(state, store, manifest, device)
    planned, error = None, None
    try:
        planned = shard_load.plan_load(state, store, manifest, device)
    except storage.CheckpointCorruptError as e:
        error = e
    wanted = planned.wanted() if planned is not None else None
    fetched = shared_reads.fetch(store, manifest, wanted, group=group, rank=rank)
    if error is not None:
        raise error
    payload, _ = shard_load.fill(state, planned, ranges_from=fetched)
    return payload, fetched.bytes_read

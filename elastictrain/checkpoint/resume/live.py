"""Resume from a survivor's memory (``--replace-in-place``): the state of the newest step any
survivor completed, sent to every rank of the new membership epoch.

The bytes are the survivor's state as one flat file (``checkpoint.state``: tensors and a
weights-only skeleton, never unpickled), checked on arrival by an XXH3-128 digest the sender
computed. Every rank loads them, the survivors too: a survivor one step behind the newest needs
them, and one load path for all is what makes the epoch bitwise a resume at that step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import xxhash

from elastictrain.checkpoint.api import Restored, ResumeOrigin, Tier
from elastictrain.checkpoint.state import train_state as tstate
from elastictrain.cluster.collectives import broadcast_bytes
from elastictrain.errors import LiveStateCorruptError


@dataclass(frozen=True)
class Live:
    """Where an in-place epoch's state comes from, as every rank agreed it
    (``inplace.agreement.EpochStart.live``)."""

    captured: dict | None
    """This rank's carried state (references to its live tensors), None for a replacement."""
    held_step: int
    """The step ``captured`` holds (-1: none)."""
    held_layout: str | None
    """Sharded: which chunks ``captured`` holds (``live_shards.signature``)."""
    source: int | None
    """Replicated: the lowest rank holding the newest step, which sends its whole state."""
    durable_step: int | None
    """The newest step committed to the durable tier, as the survivors knew it."""
    saved_world_size: int | None = None
    """The failed epoch's world size (smaller now when a lost node's ranks were dropped)."""


def fetch(
    live: Live,
    state: tstate.TrainState,
    device: torch.device,
    group: dist.ProcessGroup,
    rank: int,
    world_size: int,
) -> Restored:
    """Every rank: the source's state loaded into ``state``."""
    source = live.source
    payload = tstate.to_bytes(live.captured) if rank == source else None
    digest = xxhash.xxh3_128_digest(payload) if rank == source else None
    data = broadcast_bytes(payload if rank == source else None, group, src=source)
    expected = broadcast_bytes(digest, group, src=source)
    if xxhash.xxh3_128_digest(bytes(data)) != bytes(expected):
        raise LiveStateCorruptError(
            f"rank {rank}: the state rank {source} sent does not match its checksum"
        )
    loaded = tstate.from_bytes(data, map_location=device)
    tstate.check_compatible(state, loaded, where=f"rank {source}'s memory")
    tstate.restore(state, loaded)
    origin = ResumeOrigin(
        Tier.LIVE, remote_bytes=0, durable_step=live.durable_step, source_rank=source
    )
    return Restored(loaded, live.saved_world_size or world_size, len(data), origin)

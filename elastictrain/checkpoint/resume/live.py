"""Resume from a survivor's memory (``--replace-in-place``): the state of the newest step any
survivor completed, sent to the ranks of the new membership epoch that do not hold it.

The bytes are the survivor's state as one flat file (``checkpoint.state``: tensors and a
weights-only skeleton, never unpickled), checked on arrival by an XXH3-128 digest the sender
computed. Only the ranks that do not hold the newest step receive them (a replacement, a
survivor one step behind) and load them through the resume's restore. A survivor that holds it
restores its own carried tensors (the values the bytes would carry) with no copy through bytes;
its step's randomness and data position are functions of the step (the tests compare the run
bitwise with an uninterrupted one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import xxhash

from elastictrain.checkpoint.api import Restored, ResumeOrigin, Tier
from elastictrain.checkpoint.state import train_state as tstate
from elastictrain.cluster.collectives import as_bytes_tensor
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
    receivers: tuple[int, ...] | None = None
    """Replicated: the ranks that do not hold the newest step, which the source sends it to
    (None: every rank but the source)."""


def fetch(
    live: Live,
    state: tstate.TrainState,
    device: torch.device,
    group: dist.ProcessGroup,
    rank: int,
    world_size: int,
) -> Restored:
    """Every rank: the newest step's state in ``state``. The source sends it, point to point, to
    each rank that does not hold it; the others (the source too) keep their own."""
    source = live.source
    receivers = live.receivers
    if receivers is None:
        receivers = tuple(r for r in range(world_size) if r != source)
    origin = ResumeOrigin(
        Tier.LIVE, remote_bytes=0, durable_step=live.durable_step, source_rank=source
    )
    saved_world_size = live.saved_world_size or world_size
    if rank == source:
        _send(tstate.to_buffer(live.captured), receivers, group)
    if rank not in receivers:
        # It holds the newest step: its own carried tensors, restored into this epoch's objects
        # (the runner builds its optimizer anew each epoch) without a copy through bytes.
        tstate.restore(state, live.captured)
        return Restored(live.captured, saved_world_size, 0, origin)
    data = _receive(source, group, rank)
    loaded = tstate.from_bytes(data, map_location=device)
    tstate.check_compatible(state, loaded, where=f"rank {source}'s memory")
    tstate.restore(state, loaded)
    return Restored(loaded, saved_world_size, len(data), origin)


def _send(payload: memoryview, receivers: tuple[int, ...], group: dist.ProcessGroup) -> None:
    """The flat file, its size first and its XXH3-128 digest last, to every receiver at once."""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    digest = torch.frombuffer(bytearray(xxhash.xxh3_128_digest(payload)), dtype=torch.uint8)
    body = as_bytes_tensor(payload)
    sends = [
        dist.isend(t, group=group, group_dst=r) for r in receivers for t in (size, body, digest)
    ]
    for work in sends:
        work.wait()


def _receive(source: int, group: dist.ProcessGroup, rank: int) -> bytearray:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, group=group, group_src=source)
    data = bytearray(int(size.item()))
    dist.recv(as_bytes_tensor(data), group=group, group_src=source)
    digest = torch.zeros(16, dtype=torch.uint8)
    dist.recv(digest, group=group, group_src=source)
    if xxhash.xxh3_128_digest(data) != bytes(digest.tolist()):
        raise LiveStateCorruptError(
            f"rank {rank}: the state rank {source} sent does not match its checksum"
        )
    return data

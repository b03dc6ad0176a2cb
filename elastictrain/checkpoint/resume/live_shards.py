"""Resume sharded state (FSDP2, HSDP) from the survivors' memory (``--replace-in-place``).

A survivor keeps its own shards. A rank whose shards are in no training process (a replacement,
or a survivor whose shards moved with a smaller mesh) gets them from a survivor holding the same
chunks: under HSDP, its twin at the same shard position in another replica. What decides is the
chunks, not the ranks: each rank says which chunks it holds (its *signature*, from the failed
epoch's layout) at which step, and which it needs (from the new epoch's). The epoch resumes at
the newest step of which every rank's chunks are held by someone. When there is none (FSDP
without replicas: the dead rank's shards were only its own; a death in a window where the shard
positions disagree on the step; a mesh that shards differently now), :func:`fetch` says so and
the resume reads the fast tier's copies instead, rolling every rank back to one step, or the
durable tier: never a mix of steps.

The bytes go point to point on the epoch's gloo group, checked by an XXH3-128 digest the sender
computed, and are loaded with DCP's ``set_state_dict``, as every sharded resume is.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from elastictrain.checkpoint.api import Restored, ResumeOrigin, Tier
from elastictrain.checkpoint.resume.live import Live
from elastictrain.checkpoint.sharded.format import capture, join, split
from elastictrain.checkpoint.state import dcp
from elastictrain.checkpoint.state import train_state as tstate
from elastictrain.cluster.collectives import all_gather_object
from elastictrain.errors import LiveStateCorruptError

logger = logging.getLogger(__name__)

_HEADER = 24  # the payload's length (8 bytes) and its XXH3-128 digest (16)


def signature(dtensors: dict[str, Any]) -> str:
    """Which chunks of which tensors a rank holds: their paths, global shapes, dtypes and chunk
    boxes (DCP's chunk list), digested. Equal on two ranks exactly when their shards are
    interchangeable."""
    doc = [
        (
            path,
            list(dt.shape),
            str(dt.dtype),
            [(list(c.offsets), list(c.sizes)) for c in dt.__create_chunk_list__()],
        )
        for path, dt in sorted(dtensors.items())
    ]
    return xxhash.xxh3_64_hexdigest(json.dumps(doc).encode())


@dataclass(frozen=True)
class Plan:
    """Who loads whose shards: every rank works it out alike from one all-gather."""

    step: int
    """The step every rank resumes at."""
    sources: list[int]
    """Per rank (of this epoch): the rank whose held shards it loads (itself, when it holds them)."""


def plan(held: list[tuple[int, str | None]], wanted: list[str]) -> Plan | None:
    """``held``: per rank, (the step its shards hold, their signature), -1 and None when it holds
    none; ``wanted``: per rank, the signature of the shards it needs. The newest step of which
    every rank's shards are held, each rank loading its own where it can, else the lowest rank
    holding them; None when no step is whole."""
    for step in sorted({s for s, _ in held if s >= 0}, reverse=True):
        sources = []
        for rank, want in enumerate(wanted):
            holders = [r for r, (s, sig) in enumerate(held) if s == step and sig == want]
            if not holders:
                break
            sources.append(rank if rank in holders else holders[0])
        else:
            return Plan(step, sources)
    return None


def hold(state: tstate.TrainState, *, step: int) -> tuple[dict, str]:
    """A survivor's shards to carry into the next epoch: references to its live tensors, and
    their :func:`signature` (taken now, while the failed epoch's meshes still stand). Every FSDP
    module is resharded first: a death seen mid-forward leaves some holding gathered parameters."""
    from torch.distributed.fsdp import FSDPModule

    for module in state.model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    captured = capture(state, step=step)
    return captured, signature(split(captured)[0])


def fetch(
    live: Live, state: tstate.TrainState, group: dist.ProcessGroup, rank: int
) -> Restored | None:
    """Every rank together: the survivors' shards loaded into ``state`` (the new epoch's, its
    model sharded over the new mesh); None, with ``state`` untouched, when no step is held whole
    (the caller then reads the copies)."""
    captured = live.captured
    mine = (live.held_step, live.held_layout) if captured is not None else (-1, None)
    targets, _ = split(capture(state, step=0, targets=True))
    everyone = all_gather_object((mine, signature(targets)), group)
    found = plan([h for h, _ in everyone], [w for _, w in everyone])
    if found is None:
        if rank == 0:
            logger.warning(
                "no step's shards are all in the survivors' memory (steps held by rank: %s); "
                "every rank rolls back to the copies' newest whole step",
                [h[0] for h, _ in everyone],
            )
        return None
    source = found.sources[rank]
    data = _exchange(captured, found, group, rank)
    if data is None:  # its own shards: no bytes
        tree = _as_locals(captured)
        nbytes = 0
    else:
        tree = tstate.from_bytes(data)
        nbytes = len(data)
    payload = _load(tree, targets, state, where=f"rank {source}'s memory")
    if int(payload["progress"]["step"]) != found.step:
        raise LiveStateCorruptError(
            f"rank {rank}: rank {source}'s shards hold step {payload['progress']['step']}, "
            f"not the agreed {found.step}"
        )
    served: dict[str, list[int]] = {}
    for taker, giver in enumerate(found.sources):
        if giver != taker:
            served.setdefault(str(giver), []).append(taker)
    origin = ResumeOrigin(
        Tier.LIVE,
        remote_bytes=0,
        durable_step=live.durable_step,
        source_rank=source,
        served_by=served,
    )
    return Restored(payload, live.saved_world_size or len(everyone), nbytes, origin)


def _as_locals(captured: dict) -> dict[str, Any]:
    """A carried state as plain tensors: each DTensor its local shard (what is sent)."""
    dtensors, common = split(captured)
    return {"common": common, "locals": {p: dt.to_local() for p, dt in dtensors.items()}}


def _exchange(
    captured: dict | None, found: Plan, group: dist.ProcessGroup, rank: int
) -> bytearray | None:
    """Send this rank's shards to every rank that loads them; receive this rank's, unless it
    loads its own (None). Every send is posted before any wait, so no order can deadlock."""
    takers = [r for r, s in enumerate(found.sources) if s == rank and r != rank]
    pending = []
    if takers:
        data = tstate.to_bytes(_as_locals(captured))
        header = len(data).to_bytes(8, "little") + xxhash.xxh3_128_digest(data)
        for taker in takers:
            for part in (header, data):
                buf = torch.frombuffer(bytearray(part), dtype=torch.uint8)
                pending.append(dist.isend(buf, dst=_global(group, taker), group=group))
    received = None
    source = found.sources[rank]
    if source != rank:
        header = torch.empty(_HEADER, dtype=torch.uint8)
        dist.recv(header, src=_global(group, source), group=group)
        raw = bytes(header.numpy())
        length, digest = int.from_bytes(raw[:8], "little"), raw[8:]
        received = bytearray(length)
        dist.recv(
            torch.frombuffer(received, dtype=torch.uint8), src=_global(group, source), group=group
        )
        if xxhash.xxh3_128_digest(received) != digest:
            raise LiveStateCorruptError(
                f"rank {rank}: the shards rank {source} sent do not match their checksum"
            )
    for work in pending:
        work.wait()
    return received


def _global(group: dist.ProcessGroup, rank: int) -> int:
    return dist.get_global_rank(group, rank)


def _load(
    tree: dict[str, Any], targets: dict[str, Any], state: tstate.TrainState, where: str
) -> dict[str, Any]:
    """The held local shards as the new epoch's DTensors (its meshes and placements), loaded
    into ``state``; the payload."""
    from torch.distributed.tensor import DTensor

    held = tree["locals"]
    targets = dcp.without_optimizer_state(targets, tree["common"])
    if set(held) != set(targets):
        raise LiveStateCorruptError(f"{where} holds other tensors than this run's")
    shards = {}
    for path, target in targets.items():
        local = held[path]
        if tuple(local.shape) != tuple(target.to_local().shape):
            raise LiveStateCorruptError(f"{where}: {path} is {tuple(local.shape)} here")
        shards[path] = DTensor.from_local(
            local.to(target.device),
            target.device_mesh,
            target.placements,
            run_check=False,
            shape=target.shape,
            stride=target.stride(),
        )
    payload = join(tree["common"], shards)
    tstate.check_compatible(state, payload, where)
    dcp.load_state_dicts(state.model, state.optimizer, payload["model"], payload["optimizer"])
    tstate.restore(state, payload, model_and_optimizer=False)
    return payload

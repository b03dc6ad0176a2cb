"""Multi-node starts: prove that every node sees the checkpoint location rank 0 uses.

Why: a node-local ``--checkpoint-dir`` (``./checkpoints`` on each host) works until rank 0 lands
on another host after a re-rendezvous; there it finds no checkpoint and the whole job silently
starts over from step 0. With ``--resume-read all`` ranks on different hosts could even load
different "latest" steps. So a multi-node job refuses to start on storage its nodes do not share.

How: rank 0 writes a marker named for this start's generation; a broadcast of its bytes orders the
write before the reads; each other node's local rank 0 reads it back once; one all-gather of the
verdicts decides, so every rank stops together (exit 2) with a message naming each blind host.
Cost per start: one small object (deleted again) and one read per node. A single-node job skips it:
every rank there resolves the location on the same host.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket

import torch.distributed as dist

import storage
from elastictrain.cluster.collectives import broadcast_bytes
from elastictrain.errors import StorageNotSharedError

logger = logging.getLogger(__name__)


def marker_name(generation: int) -> str:
    return f"node-check-g{generation}.json"


def check_shared_storage(
    store: storage.CheckpointStore | None,
    group: dist.ProcessGroup | None,
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    generation: int,
    setting: str,
) -> None:
    """Raise :class:`StorageNotSharedError` on every rank unless every node reads back rank 0's
    marker. ``store``: needed on rank 0 and on each node's local rank 0. ``generation``: rank 0's
    names the marker. ``setting``: how the user spells the location (``--checkpoint-dir``)."""
    if group is None or world_size <= local_world_size:
        return
    host = socket.gethostname()
    marker = b""
    if rank == 0:
        mine = json.dumps({"generation": generation, "host": host, "location": store.location})
        try:
            store.write_marker(marker_name(generation), mine.encode())
            marker = mine.encode()
        except storage.StorageError as e:
            logger.error("node check: could not write its marker: %s", e)
    marker = bytes(broadcast_bytes(marker if rank == 0 else None, group))
    rank0 = json.loads(marker) if marker else None
    verdict = None
    if rank != 0 and local_rank == 0 and rank0:  # one reader per node (rank 0 reads for its own)
        verdict = _read_back(store, marker_name(rank0["generation"]), marker, host, rank)
    verdicts: list = [None] * world_size
    dist.all_gather_object(verdicts, verdict, group=group)
    if rank == 0 and rank0:
        with contextlib.suppress(storage.StorageError, FileNotFoundError):
            store.delete_marker(marker_name(generation))
    blind = [v for v in verdicts if v is not None]
    if rank0 is None or blind:
        raise StorageNotSharedError(_message(rank0, blind, setting))
    logger.info("node check: every node sees %s", store.location if store else "the location")


def _read_back(
    store: storage.CheckpointStore, name: str, marker: bytes, host: str, rank: int
) -> dict | None:
    """None when this node sees rank 0's marker; else what it saw instead."""
    try:
        seen = store.read_marker(name)
    except storage.StorageError as e:
        seen, problem = None, f"could not read it ({type(e).__name__}: {str(e)[:200]})"
    else:
        problem = "finds no such file" if seen is None else "finds a different file there"
    if seen == marker:
        return None
    return {"host": host, "rank": rank, "location": store.location, "problem": problem}


def _message(rank0: dict | None, blind: list[dict], setting: str) -> str:
    fix = (
        f"Every node must read and write the same storage: give all nodes the same {setting} on "
        "shared storage (s3://bucket/run, an NFS path, or a bucket mounted on every node), not a "
        "node-local folder. Nothing was loaded or changed."
    )
    if rank0 is None:
        return f"Rank 0 could not write the node-check marker to the checkpoint location. {fix}"
    lines = [
        f"host {b['host']} (rank {b['rank']}) looks for it at {b['location']!r} and {b['problem']}"
        for b in blind
    ]
    return (
        f"The nodes of this job do not share the checkpoint location: rank 0 on host "
        f"{rank0['host']} wrote {marker_name(rank0['generation'])} to {rank0['location']!r}, but "
        + "; ".join(lines)
        + f". {fix}"
    )

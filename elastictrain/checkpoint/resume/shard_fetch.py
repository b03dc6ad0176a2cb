"""Resume a sharded job from the fast tier: the newest step of which the nodes hold every rank's copy.

Each node's first rank lists the copies on its node's tier folder (``shard_tier``: its ranks' own
copies and the ones they keep for their buddies); every rank learns every node's list in one
all-gather. A step is a candidate when a copy of each of its W saved ranks is held somewhere, all
of a generation the durable location fenced, each cut by the row rule. The newest wins if it is
at least as new as the durable tier's newest; otherwise the durable tier is read, as before.

Loading takes the durable path's own pieces: DCP's load planner says which saved chunks this rank's
new shards need, :class:`ShardReader` turns them into byte ranges of saved shard files, and the
store's block-verified reads read them. Only where the bytes come from changes: a copy on this
rank's node is read from its folder; one on another node is read, verified, by that node's first
rank and sent over the process group. Three rounds, all ranks together:

1. the unsharded rest and the index, from rank 0's copy, broadcast;
2. the tables of the saved shard files this rank's new shards overlap;
3. the byte ranges of those files this rank needs (at the same world size: its own shard).

A copy that does not verify is reported (``checkpoint_corrupt``, naming its node and tier), left
out, and the choice is made again: the same step from other copies if they cover it, else an older
step, else the durable tier. Nothing is loaded into the state until every byte has arrived and
verified, so a failed choice leaves the state untouched.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import storage
from elastictrain.checkpoint.api import Corrupt, Restored, ResumeOrigin, Tier
from elastictrain.checkpoint.resume.fast_copies import (
    Copy,
    CopyReader,
    FetchedFiles,
    complete_steps,
    list_copies,
    node_id,
)
from elastictrain.checkpoint.sharded import format as sharded
from elastictrain.checkpoint.sharded import load as shard_load
from elastictrain.checkpoint.sharded import reader as shard_reader
from elastictrain.checkpoint.state import dcp
from elastictrain.checkpoint.state import train_state as tstate
from elastictrain.cluster.collectives import (
    all_gather_object,
    as_bytes_tensor,
    broadcast_bytes,
    max_int,
)

logger = logging.getLogger(__name__)


@dataclass
class Tally:
    """Bytes this rank got from its own node's memory and from other nodes, and who served."""

    local_bytes: int = 0
    peer_bytes: int = 0
    served: dict[int, set[int]] = field(default_factory=dict)
    """Saved ranks by the rank whose node served them."""

    def note(self, n: int, here: bool) -> None:
        if here:
            self.local_bytes += n
        else:
            self.peer_bytes += n


class _Refused(Exception):
    """Some rank could not read a copy of the chosen step: (copy, why) pairs, on every rank."""

    def __init__(self, bad: list[tuple[Copy, str]]) -> None:
        super().__init__(f"{len(bad)} copies did not verify")
        self.bad = bad


Need = tuple[Copy, str, "tuple[tuple[int, int], ...] | None"]


def _exchange(
    needs: list[Need], reader: CopyReader, tally: Tally, *, my_node: str, rank: int, group
) -> list[Any]:
    """Each need's bytes, all ranks together: read here when the copy is on this node, else
    asked of its holder, which reads it (verified) and sends it. Raises :class:`_Refused` on
    every rank when any copy failed anywhere."""
    out: list[Any] = [None] * len(needs)
    bad: list[tuple[Copy, str]] = []
    remote = []
    for i, (copy, name, ranges) in enumerate(needs):
        if copy.node != my_node:
            remote.append(i)
            continue
        try:
            out[i] = reader.read(copy, name, ranges)
            tally.note(len(out[i]), here=True)
        except storage.StorageError as e:
            bad.append((copy, str(e)))
    asks = all_gather_object([needs[i] for i in remote], group)
    sends, keep = _send_asked(asks, reader, rank, group, bad)
    failed_here = False
    for i in remote:
        out[i] = _receive(needs[i][0].holder, group)
        if out[i] is None:
            failed_here = True  # the holder names the copy in its own report
            continue
        tally.note(len(out[i]), here=False)
    for work in sends:
        work.wait()
    del keep  # the sent buffers live until every send is done
    if max_int(int(bool(bad) or failed_here), group):
        raise _Refused([b for got in all_gather_object(bad, group) for b in got])
    return out


def _send_asked(asks, reader: CopyReader, rank: int, group, bad: list) -> tuple[list, list]:
    """What the other ranks asked of this one (``asks``: each rank's needs), read and sent: its
    size first (-1: the copy failed, named in ``bad``), then its bytes. The sends in flight, and
    the buffers they read from."""
    sends, keep = [], []
    for requester, wanted in enumerate(asks):
        for copy, name, ranges in wanted:
            if copy.holder != rank:
                continue
            try:
                data = reader.read(copy, name, ranges)
            except storage.StorageError as e:
                data = None
                bad.append((copy, str(e)))
            size = torch.tensor([-1 if data is None else len(data)], dtype=torch.int64)
            keep += [size, data]
            sends.append(dist.isend(size, requester, group=group))
            if data:
                sends.append(dist.isend(as_bytes_tensor(data), requester, group=group))
    return sends, keep


def _receive(holder: int, group) -> bytearray | None:
    """One copy's bytes from ``holder`` (None: it failed there)."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, holder, group=group)
    if int(size.item()) < 0:
        return None
    data = bytearray(int(size.item()))
    if data:
        dist.recv(as_bytes_tensor(data), holder, group=group)
    return data


def _pick(copies: list[Copy], my_node: str | None) -> Copy:
    """The copy to read: one on this node first, then a rank's own copy before a buddy's."""
    return min(
        copies, key=lambda c: (c.node != my_node, c.kind != "own", c.holder, c.folder, c.rank)
    )


def _in_copy(name: str, saved: int, copy: Copy) -> str:
    """What saved rank ``saved``'s file ``name`` is called in ``copy``: a twin's copy holds the
    same chunks under its own rank's file names (its table says where each chunk is)."""
    if copy.rank == saved:
        return name
    for file_of in (sharded.shard_file, sharded.part_file):
        if name == file_of(saved, copy.generation):
            return file_of(copy.rank, copy.generation)
    raise ValueError(f"{name} is not a file of rank {saved}'s copy")


def _load(
    state: tstate.TrainState,
    key: tuple[int, int, int],
    copies: list[Copy],
    *,
    my_node: str,
    rank: int,
    group,
    device: torch.device,
) -> tuple[dict[str, Any], Tally]:
    generation, step, world = key
    by_rank: dict[int, list[Copy]] = defaultdict(list)  # each saved rank's copies, twins' too
    for c in copies:
        if (c.generation, c.step, c.world_size) == key:
            for saved in {c.rank, *c.twins}:
                by_rank[saved].append(c)
    reader, tally, fetched = CopyReader(), Tally(), FetchedFiles()

    # 1. The unsharded rest and the index, from rank 0's copy.
    first = _pick([c for c in by_rank[0] if c.rank == 0], None)  # only rank 0's has them
    parts: list[bytes | None] = [None, None, None]
    if rank == first.holder:
        with contextlib.suppress(storage.StorageError, ValueError, KeyError):
            manifest = reader.manifest(first)
            index_raw = bytes(reader.read(first, manifest.metadata["index_file"], None))
            common_raw = reader.read(first, json.loads(index_raw)["common"], None)
            parts = [manifest.to_json(), index_raw, common_raw]
    manifest_raw, index_raw, common_raw = (
        broadcast_bytes(part, group, src=first.holder) for part in parts
    )
    if not manifest_raw:
        raise _Refused([(first, "its index or unsharded rest did not verify")])
    manifest = storage.Manifest.from_json(bytes(manifest_raw), where=first.where)
    index = shard_reader.Index.parse(index_raw, first.where)
    fetched.files[manifest.metadata["index_file"]] = index_raw
    fetched.files[index.doc["common"]] = common_raw
    common = tstate.from_bytes(bytearray(common_raw), map_location=device)
    where = f"step {step} (fast tier)"
    shard_reader.check_fits(state, index, common, where)
    targets, _ = sharded.split(sharded.capture(state, step=0, targets=True))
    targets = dcp.without_optimizer_state(targets, common)
    rank_of = {sharded.shard_file(q, generation): q for q in range(world)}

    def exchange(needs: list[Need]) -> list[Any]:
        return _exchange(needs, reader, tally, my_node=my_node, rank=rank, group=group)

    # 2. The tables of the saved shard files this rank's new shards overlap.
    overlapped = {c["file"]: c["table"] for c in index.metadata(targets).storage_data.values()}
    sources = {name: _pick(by_rank[rank_of[name]], my_node) for name in overlapped}

    def held(name: str, file: str) -> str:  # a twin's copy holds the file under its own rank
        return _in_copy(name, rank_of[file], sources[file])

    tables = exchange([(sources[n], held(t, n), None) for n, t in overlapped.items()])
    for name in overlapped:  # by saved rank: a twin's copy serves the rank it stands in for
        tally.served.setdefault(sources[name].holder, set()).add(rank_of[name])
    fetched.files.update(zip(overlapped.values(), tables, strict=True))

    # 3. The byte ranges of those files this rank needs.
    planning = shard_reader.ShardReader(fetched, manifest, index)
    _, plan = shard_reader.plan_reads(planning, targets)
    wanted = {name: tuple(dict.fromkeys(ranges)) for name, _, _, ranges in planning.located(plan)}
    got = exchange([(sources[n], held(n, n), r) for n, r in wanted.items()])
    for (name, ranges), data in zip(wanted.items(), got, strict=True):
        view, at = memoryview(data), 0
        for lo, hi in ranges:
            fetched.ranges[(name, (lo, hi))] = view[at : at + hi - lo]
            at += hi - lo

    payload, _ = shard_load.load_into(state, fetched, manifest, device)
    return payload, tally


def fetch_fast(
    state: tstate.TrainState,
    tier_dir: str | None,
    durable: storage.Store | None,
    *,
    group: dist.ProcessGroup | None,
    rank: int,
    local_rank: int,
    device: torch.device,
    on_corrupt: Corrupt,
) -> Restored | None:
    """Every rank together: the newest step the fast tier holds whole, loaded into ``state``;
    None when no step on it is as new as the durable tier's newest. ``durable``: the store, on rank 0. ``tier_dir``: this node's
    tier folder (None: the tier is off here, and this node offers nothing)."""
    if group is None:
        return None  # one process: no node to lose, and the durable tier is as close
    mine: dict[str, Any] = {"copies": []}
    if tier_dir and local_rank == 0:
        mine["copies"] = list_copies(tier_dir, rank)
    if rank == 0:
        try:
            newest = durable.ranked_manifests()
            mine["fence"] = durable.read_fence()
            mine["durable"] = (newest[0].generation, newest[0].step) if newest else None
        except storage.StorageError:
            mine["fence"] = None  # the durable path that follows reports it
    offers = all_gather_object(mine, group)
    fence, durable_newest = offers[0]["fence"], offers[0].get("durable")
    copies = [c for offer in offers for c in offer["copies"]]
    if fence is None or not copies:
        return None
    my_node = node_id(tier_dir) if tier_dir else f"no tier on rank {rank}"
    while True:
        keys = complete_steps(copies, fence, durable_newest)
        if not keys:
            return None
        try:
            payload, tally = _load(
                state, keys[0], copies, my_node=my_node, rank=rank, group=group, device=device
            )
        except _Refused as refused:
            for copy, why in refused.bad:
                if rank == 0:
                    logger.error("CORRUPT CHECKPOINT (fast tier) skipped: %s: %s", copy.where, why)
                    on_corrupt(copy.step, f"{copy.where}: {why}", Tier.FAST)
            refused_copies = {copy for copy, _ in refused.bad}
            if not refused_copies:
                return None
            copies = [c for c in copies if c not in refused_copies]
            continue
        origin = _origin(tally, durable_newest, group)
        return Restored(payload, keys[0][2], tally.local_bytes + tally.peer_bytes, origin)


def _origin(tally: Tally, durable_newest: tuple[int, int] | None, group) -> ResumeOrigin:
    """The resume event's account: bytes from node memory and from peers, job-wide, and which
    node served which saved ranks (nodes named by their first rank)."""
    tallies = all_gather_object(tally, group)
    served: dict[int, set[int]] = defaultdict(set)
    for t in tallies:
        for holder, ranks in t.served.items():
            served[holder] |= ranks
    return ResumeOrigin(
        Tier.FAST,
        remote_bytes=0,
        durable_step=durable_newest[1] if durable_newest else None,
        source_rank=min(served, default=0),
        local_bytes=sum(t.local_bytes for t in tallies),
        peer_bytes=sum(t.peer_bytes for t in tallies),
        served_by={str(h): sorted(r) for h, r in sorted(served.items())},
    )

"""The fast tier for sharded (FSDP) state: every rank's shards in its node's memory, and on a peer.

Each rank keeps its own copies, on the node's tier folder (``local_tier``'s, /dev/shm by default):

    <tier>/shards/own-r00003/step-N/    rank 3's shard, its table; rank 0's also the unsharded
                                        rest and the index. Its own manifest, last.
    <tier>/shards/peer-r00001/step-N/   the same files of rank 1 (the buddy), as rank 1 sent them

Every rank commits its own copy with the durable tier's rules (payload first, manifest last,
checksums, the writer's generation, the newest 2 kept): a copy per rank, not per node, so no node
needs to gather its ranks to commit. Right after, in the same background thread, it sends the copy
to its buddy, the rank one node further on, ``(rank + L) % W`` for L ranks per node, and receives
the copy of ``(rank - L) % W``, which it commits into a ``peer-`` folder once every byte matches
the sender's manifest. A node lost takes its copies with it; the next node holds them. The pairing
follows the ranks, so it changes with the membership.

Under HSDP with a replica of this rank's shards on another node (``RankCopyLayout.stands_in``),
each copy holds every replica's chunks and names its twins, the replicas' copies stand in for
each other, and only rank 0 (whose copy alone has the index) still sends one to its buddy.

Copies are collective in one way: every rank must take them at the same steps, or a buddy would
wait for a copy that never comes. So the ranks agree at each copy (one all-reduce of two integers)
on whether every rank can go on (room, no failed write) and on the next interval (``auto``: the
longest any rank needs to stay under ``--local-overhead``). The transfer runs on a gloo group of
its own: training's collectives never queue behind it.

Resume (``shard_fetch``) finds the newest step of which some node holds every rank's copy.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import storage
from elastictrain.checkpoint.sharded import format as sharded
from elastictrain.checkpoint.state import train_state as tstate
from elastictrain.checkpoint.tiers.local import (
    KEEP,
    LocalTier,
    payload_bytes,
    remove_copies,
    tier_dir,
)
from elastictrain.checkpoint.write.layouts import ShardSnap, ShardSnapshots
from elastictrain.cluster.collectives import as_bytes_tensor, barrier, max_int, max_ints
from elastictrain.config import CheckpointConfig
from elastictrain.observe.events import EventLog
from storage.hashing import digest

logger = logging.getLogger(__name__)

SHARDS = "shards"


def own_folder(tier_dir: str, rank: int) -> str:
    return os.path.join(tier_dir, SHARDS, f"own-r{rank:05d}")


def peer_folder(tier_dir: str, rank: int) -> str:
    return os.path.join(tier_dir, SHARDS, f"peer-r{rank:05d}")


def buddies(rank: int, world_size: int, local_world_size: int) -> tuple[int, int] | None:
    """(the rank this one sends its copy to, the rank whose copy it keeps): one node further on,
    and one node back. None in a job of one node: there is no other node to hold a copy."""
    if world_size <= local_world_size:
        return None
    return (rank + local_world_size) % world_size, (rank - local_world_size) % world_size


class Buddy:
    """Sends this rank's copy to its buddy and keeps the copy of the rank that sends to it."""

    def __init__(self, tier_dir: str, rank: int, pair: tuple[int, int], group, checksum: str):
        self.to, self.source = pair
        self.group = group
        self.store = storage.open_store(
            peer_folder(tier_dir, self.source),
            checksum=checksum,
            retry=storage.RetryPolicy(deadline_s=5.0),
        )
        self.received_bytes = 0

    def exchange(self, manifest: storage.Manifest | None, files: dict[str, Any]) -> None:
        """Send ours (or word that there is none, so the buddy never waits for it), then receive
        and commit the source's. Sends are posted first on every rank: nobody waits on a peer
        that is itself waiting to send."""
        header = b"" if manifest is None else _header(manifest, files)
        sizes = torch.tensor([len(header)], dtype=torch.int64)
        sends = [dist.isend(sizes, self.to, group=self.group)]
        if header:
            sends.append(dist.isend(as_bytes_tensor(header), self.to, group=self.group))
            sends += [
                dist.isend(as_bytes_tensor(data), self.to, group=self.group)
                for data in files.values()
                if len(data)
            ]
        try:
            copy = self._receive()
            if copy is not None:
                self.keep(*copy)
        finally:
            for work in sends:
                work.wait()

    def _receive(self) -> tuple[storage.Manifest, dict[str, bytearray]] | None:
        """The source's copy off the wire: its manifest and files (None: it sent none)."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, self.source, group=self.group)
        if not int(size.item()):
            return None  # the source has no copy this time (its write failed)
        raw = bytearray(int(size.item()))
        dist.recv(as_bytes_tensor(raw), self.source, group=self.group)
        doc = json.loads(bytes(raw))
        manifest = storage.Manifest.from_json(doc["manifest"].encode(), where="a buddy's copy")
        # Every message of this copy is taken off the wire before anything can fail, so the next
        # copy's messages are never read as this one's.
        received = {}
        for name in doc["order"]:
            received[name] = bytearray(manifest.files[name].size)
            if received[name]:
                dist.recv(as_bytes_tensor(received[name]), self.source, group=self.group)
            self.received_bytes += len(received[name])
        return manifest, received

    def keep(self, manifest: storage.Manifest, received: dict[str, bytearray]) -> None:
        """Commit the source's copy into its peer folder, once every byte matches the sender's
        manifest, with the durable tier's rules (write-once, manifest last)."""
        step, entries = manifest.step, {}
        if self._holds(manifest):
            return  # the same copy again (a repeated step): kept as it is, never written again
        for name, data in received.items():
            # Checked before it is published: a name, once written, is never written again.
            entry = manifest.files[name]
            got = digest(data, entry.block_size, entry.algorithm).root
            if (len(data), got) != (entry.size, entry.checksum):
                raise storage.CheckpointCorruptError(
                    f"rank {self.source}'s copy of step {step} arrived with {name} changed "
                    f"({got[:16]}... against {entry.checksum[:16]}...); not kept"
                )
        for name, data in received.items():
            entries[name] = self.store.write_file(
                step, name, data, manifest.files[name].block_size
            )[0]
        # An older attempt's copy of the same step is replaced only once this one is published.
        self.store.commit_written(
            step, entries, manifest.metadata, manifest.generation, replace_older=True
        )
        self.store.apply_retention(KEEP, newest_good=step)

    def _holds(self, manifest: storage.Manifest) -> bool:
        """This copy is committed here already: the same generation and the same files."""
        try:
            held = self.store.read_manifest(manifest.step)
        except storage.CheckpointCorruptError:
            return False  # unreadable: the new copy is published over it
        return (
            held is not None
            and held.generation == manifest.generation
            and held.files == manifest.files
        )


def _header(manifest: storage.Manifest, files: dict[str, Any]) -> bytes:
    order = [name for name in files]
    return json.dumps({"manifest": manifest.to_json().decode(), "order": order}).encode()


class RankCopyLayout:
    """One rank's copy: its shard and table (and on rank 0 the rest and the index), committed by
    the rank alone, then handed to its buddy. Snapshots as the durable tier's sharded layout does,
    into buffers of its own."""

    def __init__(
        self, rank: int, world_size: int, buddy: Buddy | None, local_world_size: int = 1
    ) -> None:
        self.rank, self.world_size, self.buddy = rank, world_size, buddy
        self.local_world_size = local_world_size
        self._snapshots = ShardSnapshots(rank)
        self.twins = [rank]

    def snapshot(self, payload: Any) -> ShardSnap:
        self.twins = sharded.twins(sharded.split(payload)[0])
        return self._snapshots.snapshot(payload, every_replica=self.stands_in())

    def stands_in(self) -> bool:
        """Whether a twin (a replica of this rank's shards) is on another node. Then this copy
        holds every replica's chunks, not only the ones this rank writes, and so does the twin's:
        each node's copies stand in for the other's, and no buddy transfer is needed."""
        node = self.rank // self.local_world_size
        return any(t // self.local_world_size != node for t in self.twins)

    def write_own(self, store: storage.Store, step: int, snap: ShardSnap, generation: int) -> None:
        """Everything is written in :meth:`commit`: the rank is its own committer."""

    def commit(
        self,
        store: storage.Store,
        step: int,
        snap: ShardSnap,
        generation: int,
        metadata: dict[str, Any],
        *,
        before_commit: Callable[[], None],
        abandoned: Callable[[int], bool],
        deadline_s: float,
        replace_older: bool = False,
    ) -> storage.Manifest:
        """No receipts to wait for (``abandoned``, ``deadline_s``): the copy is this rank's."""
        manifest, files = None, {}
        try:
            manifest, files = self._commit(
                store, step, snap, generation, metadata, before_commit, replace_older
            )
        finally:
            if self.buddy is not None:
                # Rank 0 always sends: its copy alone holds the index and the unsharded rest.
                spared = self.rank != 0 and self.stands_in()
                self.buddy.exchange(None if spared else manifest, files)
        return manifest

    def _commit(
        self,
        store: storage.Store,
        step: int,
        snap: ShardSnap,
        generation: int,
        metadata: dict[str, Any],
        before_commit: Callable[[], None],
        replace_older: bool,
    ) -> tuple[storage.Manifest, dict[str, Any]]:
        name = sharded.shard_file(self.rank, generation)
        entry, digest = store.write_file(step, name, snap.shards.data, sharded.BLOCK_BYTES)
        table = sharded.part_report(snap.local, snap.shards.placement, name, entry, digest.blocks)
        files: dict[str, Any] = {
            name: snap.shards.data,
            sharded.part_file(self.rank, generation): table,
        }
        regular = snap.local.follows_row_rule(self.world_size, self.rank)
        # A resume takes a step only if every rank's copy follows the row rule, or the same grids.
        meta = {**metadata, "rank": self.rank, "regular": regular, "grid": snap.local.grid_digest()}
        if self.stands_in():
            meta["twins"] = self.twins  # the saved ranks whose chunks this copy holds
        if snap.common is not None:  # rank 0: what every resume needs besides the shards
            common = sharded.common_file(generation)
            files[common] = snap.common.data
            index = sharded.index_file(generation)
            # Computed from rank 0's own rule: a resume checks every copy's (``complete_steps``);
            # a copy that follows none is never resumed, whatever its index says.
            files[index] = sharded.computed_index(
                snap.local, [meta], common, self.world_size, generation
            ) or sharded.build_rule_index(snap.local.chunks, common, self.world_size, generation)
            meta["index_file"] = index
        entries = {name: entry}
        for other, data in files.items():
            if other != name:
                entries[other] = store.write_file(step, other, data)[0]
        manifest = store.commit_written(
            step,
            entries,
            meta,
            generation=generation,
            before_commit=before_commit,
            replace_older=replace_older,
        )
        return manifest, files


class RankCopies:
    """What a copy is for sharded state: each rank's own shards, in a folder of its own, written
    by every rank and handed to its buddy (``NodeCopies`` is the replicated kind)."""

    def __init__(self, rank: int, local_world_size: int, buddy: Buddy | None) -> None:
        self.rank, self.local_world_size, self.buddy = rank, local_world_size, buddy

    def folder(self, tier_dir: str, rank: int) -> str:
        return own_folder(tier_dir, rank)

    def writes(self, local_rank: int) -> bool:
        return True

    def layout(self, world_size: int) -> RankCopyLayout:
        return RankCopyLayout(self.rank, world_size, self.buddy, self.local_world_size)

    def capture(self, state: tstate.TrainState, step: int) -> dict[str, Any]:
        return sharded.capture(state, step=step)

    def copy_bytes(self, captured: dict[str, Any]) -> int:
        """The node's part of one copy: each of its ranks' shards, and as much again for the
        buddy's (equal shards), plus the unsharded rest."""
        shards, rest = sharded.split(captured)
        own = sum(payload_bytes(t.to_local()) for t in shards.values())
        return self.local_world_size * 2 * own + payload_bytes(rest)


class ShardTier(LocalTier):
    """One per rank: this rank's copies, and its buddy's (see the module's docstring). The local
    tier's machinery (folder, lock, room, schedule, persister) with :class:`RankCopies`, plus
    what makes copies collective: every rank copies at the same agreed steps."""

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        rank: int,
        local_rank: int,
        world_size: int,
        local_world_size: int,
        generation: Callable[[], int],
        events: EventLog,
        attached: Callable[[], bool],
        group: dist.ProcessGroup | None,
    ) -> None:
        self.local_world_size, self.group = local_world_size, group
        self.agreed_interval = 1
        pair = buddies(rank, world_size, local_world_size) if group is not None else None
        self.buddy: Buddy | None = None
        if pair is not None and config.local_checkpoint:
            # Every rank creates the transfer group (a collective), whatever its tier decides
            # next; the buddy opens its peer folder's store, which creates nothing on disk.
            transfer = dist.new_group(
                backend="gloo", timeout=timedelta(seconds=config.checkpoint_timeout)
            )
            self.buddy = Buddy(tier_dir(config), rank, pair, transfer, config.checksum)
        super().__init__(
            config,
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            generation=generation,
            events=events,
            attached=attached,
            copies=RankCopies(rank, local_world_size, self.buddy),
        )
        # Copies are taken by all ranks or none: a rank whose folder is unusable stops them all.
        if max_int(int(not self.active), group) and self.active:
            self._off("another rank's local tier is off (see its log)")

    # -- save: all ranks at the same steps -----------------------------------------------------
    def after_step(self, step: int, state: tstate.TrainState, *, durable_saved: bool) -> None:
        if not self.active:
            return
        due = self._due(step) and self.schedule.last != step  # as in ``LocalTier.after_step``
        writing = self._writing_since or self.writer.writing
        self.schedule.observe(skip=durable_saved, writing=writing)
        if due:
            why = self._why_not(step, state)
            # One agreement per copy: whether every rank goes on, and the next interval.
            wanted = self.schedule.interval() if self.schedule.every == "auto" else 1
            anyone_stops, interval = max_ints([int(why is not None), wanted], self.group)
            if anyone_stops:
                self._off(why or "another rank's local tier cannot go on (see its log)")
                return
            self.agreed_interval = interval
            self._sized = True
            self.save(step, state)
        self._writing_since = self.active and self.writer.writing

    def room(self, state: tstate.TrainState, step: int) -> None:
        """None: sizing shards at a start takes DCP's state dict, which steps a fresh optimizer
        (torch's ``_init_optim_state``); the tier checks its room at its first copy instead."""
        return None

    def _due(self, step: int) -> bool:
        """The same answer on every rank: from the step count, the agreed interval, and (before
        the first copy) whether a step time has been measured, which all ranks do at one step."""
        schedule = self.schedule
        if schedule.every != "auto":
            return step % int(schedule.every) == 0
        if schedule.step_s is None:
            return False
        return schedule.last is None or step - schedule.last >= self.agreed_interval

    def own_stores(self) -> list[storage.CheckpointStore]:
        """This rank's own copies, and the copies it keeps for its buddy's source."""
        return super().own_stores() + ([self.buddy.store] if self.buddy is not None else [])

    def _off(self, why: str) -> None:
        super()._off(why)
        self.buddy = None

    # -- end -------------------------------------------------------------------------------------
    def remove(self) -> None:
        """Every rank has committed the durable tier's final state: each waits for its copy in
        flight, then the node's first rank removes the node's copies."""
        if self.writer is not None:
            self.writer.wait()
        barrier(self.group)
        if self.config.local_checkpoint and self.local_rank == 0:
            remove_copies(os.path.join(self.dir, SHARDS))
        self.writes, self.writer, self.store = False, None, None
        self.finish()

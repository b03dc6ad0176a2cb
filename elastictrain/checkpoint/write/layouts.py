"""What each rank puts on storage for one checkpoint: the persister's two strategies.

- :class:`FlatLayout` (DDP, one process): rank 0 writes the whole state as one flat file.
- :class:`ShardedLayout` (FSDP2): every rank writes its own shards and posts a receipt once they
  are durable (``receipts``); rank 0 writes the unsharded rest, gathers every receipt, writes the
  index and commits.

Both snapshot into reused staging buffers (the only part that blocks training) and commit with one
manifest, written last, listing every file with its size and hash.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import storage
from elastictrain.checkpoint.sharded import format as sharded
from elastictrain.checkpoint.state import train_state as tstate
from elastictrain.checkpoint.state.flat import Snapshot, Staging
from elastictrain.checkpoint.write.receipts import Receipts, for_job, read_all
from elastictrain.checkpoint.write.receipts import ShardsMissingError as ShardsMissingError
from storage.hashing import hex_digest


class FlatLayout:
    """DDP: the whole state, from rank 0, as one file."""

    def __init__(self) -> None:
        self.staging = Staging()

    def snapshot(self, payload: Any) -> Snapshot:
        return self.staging.snapshot(payload)

    def write_own(self, store: storage.Store, step: int, snap: Snapshot, generation: int) -> None:
        """Nothing before the commit: rank 0 writes the one file in it."""

    def commit(
        self,
        store: storage.Store,
        step: int,
        snap: Snapshot,
        generation: int,
        metadata: dict[str, Any],
        *,
        before_commit: Callable[[], None],
        abandoned: Callable[[int], bool],
        deadline_s: float,
        replace_older: bool = False,
    ) -> storage.Manifest:
        name = tstate.state_file_name(generation)
        return store.commit(
            step,
            {name: snap.data},
            {**metadata, "state_file": name},
            generation=generation,
            before_commit=before_commit,
            replace_older=replace_older,
        )


@dataclass
class ShardSnap:
    local: sharded.LocalShards
    shards: Snapshot
    common: Snapshot | None

    @property
    def nbytes(self) -> int:
        return len(self.shards.data) + (len(self.common.data) if self.common else 0)

    def wait(self) -> None:
        self.shards.wait()
        if self.common is not None:
            self.common.wait()

    def non_finite(self) -> list[str]:
        return self.shards.non_finite() + (self.common.non_finite() if self.common else [])


class ShardSnapshots:
    """A rank's sharded snapshots: its shards into one reused buffer, and on rank 0 the unsharded
    rest into another; DCP's plan of the shards cached while it holds."""

    def __init__(self, rank: int) -> None:
        self.staging = Staging()
        self.common_staging = Staging() if rank == 0 else None
        self._plan_cache: dict = {}

    @torch.no_grad()  # DTensor.to_local is then a plain attribute read, not an autograd op
    def snapshot(self, payload: Any, every_replica: bool = False) -> ShardSnap:
        """``every_replica``: the chunks other replicas write too (``sharded.local_shards``)."""
        dtensors, common = sharded.split(payload)
        local = sharded.local_shards(dtensors, self._plan_cache, every_replica)
        shards = self.staging.snapshot(local.tensors)
        common_snap = self.common_staging.snapshot(common) if self.common_staging else None
        return ShardSnap(local, shards, common_snap)


class ShardedLayout:
    """FSDP2: every rank writes its own shards; rank 0 commits once every rank reported."""

    def __init__(self, rank: int, world_size: int, receipts: Receipts | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        # The job's c10d store when torch.distributed runs, else files beside the shards.
        self.receipts = receipts or for_job(world_size)
        self.snapshots = ShardSnapshots(rank)

    def snapshot(self, payload: Any) -> ShardSnap:
        return self.snapshots.snapshot(payload)

    def write_own(self, store: storage.Store, step: int, snap: ShardSnap, generation: int) -> None:
        """This rank's shard file, its table, then its receipt: the receipt means "durable"."""
        name = sharded.shard_file(self.rank, generation)
        entry, digest = store.write_file(step, name, snap.shards.data, sharded.BLOCK_BYTES)
        table = sharded.part_report(snap.local, snap.shards.placement, name, entry, digest.blocks)
        store.write_note(step, sharded.part_file(self.rank, generation), table)
        table_entry = storage.FileEntry(
            len(table), hex_digest(table, store.checksum), algorithm=store.checksum
        )
        regular = snap.local.follows_row_rule(self.world_size, self.rank)
        receipt = sharded.receipt(entry, table_entry, regular, snap.local.grid_digest())
        self.receipts.post(store, step, generation, self.rank, receipt)

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
        common_name = sharded.common_file(generation)
        entries = {common_name: store.write_file(step, common_name, snap.common.data)[0]}
        receipts = self.receipts.gather(store, step, generation, abandoned, deadline_s)
        for rank, got in enumerate(receipts):
            entries[sharded.shard_file(rank, generation)] = storage.FileEntry.from_doc(got["shard"])
            # Listed too: its block digests are what a resharding reader verifies ranges with.
            entries[sharded.part_file(rank, generation)] = storage.FileEntry.from_doc(got["part"])
        index = sharded.computed_index(
            snap.local, receipts, common_name, self.world_size, generation
        )
        if index is None:  # some rank's chunks follow no rule: list every chunk, from its table
            names = [sharded.part_file(r, generation) for r in range(self.world_size)]
            tables = read_all(lambda name: store.read_uncommitted(step, name), names)
            index = sharded.build_index([json.loads(t) for t in tables], common_name, generation)
        index_name = sharded.index_file(generation)
        entries[index_name] = store.write_file(step, index_name, index)[0]
        # The receipts came through the job's store, not from storage: every file they name must
        # be there at its size before a manifest lists it (one listing, paged, at any W).
        store.check_sizes(storage.Manifest(step=step, files=entries))
        return store.commit_written(
            step,
            entries,
            {**metadata, "index_file": index_name, "shards": self.world_size},
            generation=generation,
            before_commit=before_commit,
            replace_older=replace_older,
        )

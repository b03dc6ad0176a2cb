"""Sharded snapshots built by hand, for the writers' unit tests: what each of W ranks of an FSDP2
job would hand its persister, without a process group (``ShardedLayout.write_own`` and rank 0's
``commit`` take them as they are)."""

from __future__ import annotations

from typing import Any

import torch

from elastictrain.checkpoint.sharded import format as sharded
from elastictrain.checkpoint.state.flat import Staging
from elastictrain.checkpoint.write.layouts import ShardedLayout, ShardSnap


def rank_snaps(world: int, *, step: int = 5, rows: int = 64, extra: Any = None) -> list[ShardSnap]:
    """One snapshot per rank of a (rows x 16) weight split by rows as FSDP2 splits it; rank 0's
    also holds the unsharded rest (the progress, and ``extra``)."""
    snaps = []
    for rank in range(world):
        first, count = sharded.rows_of(rows, world, rank)
        tensors = {"model/w": torch.full((count, 16), float(rank + 1))}
        chunks = [{"fqn": "model/w", "dtype": "float32", "size": [rows, 16],
                   "offsets": [first, 0], "sizes": [count, 16]}]  # fmt: skip
        common = Staging().snapshot({"step": step, "extra": extra}) if rank == 0 else None
        snaps.append(
            ShardSnap(sharded.LocalShards(tensors, chunks), Staging().snapshot(tensors), common)
        )
    return snaps


class Prebuilt(ShardedLayout):
    """The sharded layout, handed its snapshot ready made: ``state()`` returns a ``ShardSnap``."""

    def snapshot(self, payload: Any) -> ShardSnap:
        return payload

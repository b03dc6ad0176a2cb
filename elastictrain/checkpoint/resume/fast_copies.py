"""The fast tier's copies as a resume sees them: each listed by its node, the steps they hold
whole, and their files read on their node, verified (``FetchedFiles``: what reached this rank,
readable as a store by the sharded reader)."""

from __future__ import annotations

import json
import logging
import os
import socket
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import storage
from elastictrain.checkpoint.sharded import format as sharded
from elastictrain.checkpoint.tiers.shards import SHARDS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Copy:
    """One committed copy of one saved rank's shards, on one node."""

    generation: int
    step: int
    world_size: int
    rank: int
    """The saved rank whose shards these are."""
    regular: bool
    """Its chunks follow the row rule."""
    grid: str | None
    """Else the digest of the grids its chunks follow (HSDP, tensor parallelism), if any."""
    node: str
    holder: int
    """The rank of this attempt that listed it and serves it to other nodes (its node's first)."""
    folder: str
    kind: str
    """``own`` (written on this node by that rank) or ``peer`` (received from it)."""
    twins: tuple[int, ...] = ()
    """The saved ranks whose chunks it holds as well (HSDP: its replicas, when one is on another
    node: ``RankCopyLayout.stands_in``); empty when it holds only its own rank's."""

    @property
    def where(self) -> str:
        return f"rank {self.rank}'s {self.kind} copy on the node of rank {self.holder}"


def node_id(tier_dir: str) -> str:
    """Which node a folder is on: the host and the folder (two simulated nodes on one host keep
    their tiers in different folders)."""
    return f"{socket.gethostname()}:{os.path.realpath(tier_dir)}"


def list_copies(tier_dir: str, holder: int) -> list[Copy]:
    """Every committed copy on this node's tier folder."""
    root, found = os.path.join(tier_dir, SHARDS), []
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    for name in names:
        kind = name.split("-", 1)[0]
        folder = os.path.join(root, name)
        try:
            manifests = storage.open_store(folder).ranked_manifests()
        except storage.StorageError as e:
            logger.warning("fast tier folder %s unreadable, not used for resume: %s", folder, e)
            continue
        for m in manifests:
            found.append(
                Copy(
                    m.generation,
                    m.step,
                    int(m.metadata.get("world_size") or 0),
                    int(m.metadata.get("rank", -1)),
                    bool(m.metadata.get("regular")),
                    m.metadata.get("grid"),
                    node_id(tier_dir),
                    holder,
                    folder,
                    kind,
                    tuple(m.metadata.get("twins", ())),
                )
            )
    return found


def complete_steps(
    copies: list[Copy], fence: int, durable_newest: tuple[int, int] | None
) -> list[tuple[int, int, int]]:
    """(generation, step, saved world size) of every step some copy of each saved rank covers
    (its own, or a twin's that holds its chunks too), newest first, none older than the durable
    tier's newest. Its index is rank 0's, computed, so rank 0's own copy must be there; every copy
    must follow the row rule, or all the same grids."""
    covered: dict[tuple[int, int, int], set[int]] = defaultdict(set)
    rules: dict[tuple[int, int, int], set[str | None]] = defaultdict(set)
    indexed: set[tuple[int, int, int]] = set()
    for c in copies:
        if not 0 < c.generation <= fence or c.world_size < 1:
            continue  # a generation the durable location never fenced: another run's, or wiped
        key = (c.generation, c.step, c.world_size)
        covered[key] |= {c.rank, *c.twins}
        rules[key].add("rows" if c.regular else c.grid)
        if c.rank == 0:
            indexed.add(key)
    good = [
        k
        for k, ranks in covered.items()
        if len(rules[k]) == 1 and None not in rules[k] and ranks >= set(range(k[2]))
        if k in indexed
    ]
    if durable_newest is not None:
        good = [k for k in good if (k[0], k[1]) >= durable_newest]
    return sorted(good, reverse=True)


class CopyReader:
    """Reads copies on this node, verified; stores, manifests and tables read once."""

    def __init__(self) -> None:
        self._stores: dict[str, storage.Store] = {}
        self._manifests: dict[Copy, storage.Manifest] = {}
        self._tables: dict[Copy, dict[str, Any]] = {}

    def manifest(self, copy: Copy) -> storage.Manifest:
        if copy not in self._manifests:
            store = self._stores.setdefault(copy.folder, storage.open_store(copy.folder))
            manifest = store.read_manifest(copy.step)
            if manifest is None or manifest.generation != copy.generation:
                raise storage.CheckpointCorruptError(f"{copy.where} of step {copy.step} is gone")
            self._manifests[copy] = manifest
        return self._manifests[copy]

    def read(self, copy: Copy, name: str, ranges: tuple | None) -> bytes | memoryview:
        manifest = self.manifest(copy)
        store = self._stores[copy.folder]
        if ranges is None:
            return store.read_file(manifest, name)
        if copy not in self._tables:
            table = store.read_file(manifest, sharded.part_file(copy.rank, copy.generation))
            self._tables[copy] = json.loads(bytes(table))
        views, _ = store.read_ranges(manifest, name, self._tables[copy]["blocks"], list(ranges))
        return b"".join(views[r] for r in ranges)


class FetchedFiles:
    """What this rank fetched, as a store to :func:`shard_load.load_into`."""

    safe_url = "the fast tier"

    def __init__(self) -> None:
        self.files: dict[str, bytes | bytearray | memoryview] = {}
        self.ranges: dict[tuple[str, tuple[int, int]], memoryview] = {}

    def read_file(self, manifest: storage.Manifest, name: str) -> bytes | bytearray | memoryview:
        return self.files[name]

    def read_ranges(self, manifest, name, blocks, ranges):
        views = {r: self.ranges[(name, r)] for r in ranges}
        return views, sum(len(v) for v in views.values())

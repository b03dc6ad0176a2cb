"""Reading a sharded checkpoint back: at any world size, only the bytes needed, every one verified.

DCP's ``DefaultLoadPlanner`` works out from the index (DCP's ``Metadata``, kept as JSON) which slice
of which saved chunk each of this rank's tensors needs; :class:`ShardReader`, a DCP
``StorageReader``, turns each into a byte range of a shard file and reads it through the store,
block-verified. Also: the consolidated whole state in one process, for ``load_checkpoint`` and
``export``. The format is described in :mod:`elastictrain.checkpoint.sharded.format`.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

import storage
from elastictrain.checkpoint.sharded.format import (
    GRID_INDEX_FORMAT,
    INDEX_FORMAT,
    RULE_INDEX_FORMAT,
    join,
    part_file,
    rows_of,
    shard_file,
)
from elastictrain.checkpoint.sharded.grid import Grid
from elastictrain.checkpoint.state import train_state as tstate


@dataclass(frozen=True)
class Index:
    doc: dict[str, Any]

    @classmethod
    def parse(cls, raw: bytes | memoryview, where: str) -> Index:
        try:
            doc = json.loads(bytes(raw))
            fmt = doc.get("format")
        except (ValueError, AttributeError) as e:
            raise storage.CheckpointCorruptError(f"Index of {where} is unreadable: {e}.") from e
        if fmt in (INDEX_FORMAT, RULE_INDEX_FORMAT, GRID_INDEX_FORMAT):
            return cls(doc)
        family, _, version = str(fmt).rpartition("/")
        if family == "elastictrain-sharded" and version.isdigit() and int(version) > 3:
            raise storage.NewerFormatError(
                f"The index of {where} is {fmt}, newer than this elastictrain reads (up to "
                f"{GRID_INDEX_FORMAT}). Nothing was loaded or changed: resume it with the release "
                "that wrote it, or a newer one."
            )
        raise storage.CheckpointCorruptError(
            f"Index of {where} is unreadable: unsupported index format {fmt!r}."
        )

    @property
    def by_rule(self) -> bool:
        """Each rank's chunks are computed (formats 2 and 3), not listed (format 1)."""
        return self.doc["format"] in (RULE_INDEX_FORMAT, GRID_INDEX_FORMAT)

    def metadata(self, targets: dict[str, torch.Tensor] | None = None) -> Metadata:
        """DCP's ``Metadata``, so its load planner can compute what each rank reads. By the row
        rule, only the saved chunks that ``targets`` (this rank's tensors) overlap: a rank's plan
        then costs the same at any saved world size."""
        state_dict_metadata, storage_data = {}, {}
        saved = self.doc["tensors"]
        wanted_fqns = saved if targets is None else [f for f in targets if f in saved]
        for fqn in wanted_fqns:
            t = saved[fqn]
            if "grid" in t:
                lo, hi = _box_wanted(targets.get(fqn) if targets else None, t)
                chunks = self._grid_chunks(t, lo, hi)
            elif self.by_rule:
                wanted = _rows_wanted(targets.get(fqn) if targets else None, t)
                chunks = self._rule_chunks(fqn, t, wanted)
            else:
                chunks = t["chunks"]
            listed = []
            for i, c in enumerate(chunks):
                listed.append(
                    ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"]))
                )
                storage_data[MetadataIndex(fqn, torch.Size(c["offsets"]), i)] = {
                    **c,
                    "fqn": fqn,
                    "dtype": t["dtype"],
                }
            state_dict_metadata[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=getattr(torch, t["dtype"])), torch.Size(t["size"]), listed
            )
        return Metadata(state_dict_metadata=state_dict_metadata, storage_data=storage_data)

    def _rule_chunks(self, fqn: str, t: dict[str, Any], wanted: tuple[int, int]):
        rows, world = t["size"][0], self.doc["world"]
        per = -(-rows // world)
        lo, hi = wanted
        if hi <= lo:
            return []
        chunks = []
        for rank in range(lo // per, min(world, (hi - 1) // per + 1)):
            first, count = rows_of(rows, world, rank)
            if count:
                chunks.append(
                    {
                        "offsets": [first, *[0] * (len(t["size"]) - 1)],
                        "sizes": [count, *t["size"][1:]],
                        "file": shard_file(rank, self.doc["generation"]),
                        "table": part_file(rank, self.doc["generation"]),
                    }
                )
        return chunks

    def _grid_chunks(self, t: dict[str, Any], lo: list[int], hi: list[int]):
        gen = self.doc["generation"]
        return [
            {
                "offsets": offsets,
                "sizes": sizes,
                "file": shard_file(rank, gen),
                "table": part_file(rank, gen),
            }
            for rank, offsets, sizes in Grid.from_doc(t["size"], t["dtype"], t["grid"]).within(
                lo, hi
            )
        ]

    def chunk_count(self, fqn: str) -> int:
        """How many ranks saved a part of this tensor."""
        t = self.doc["tensors"][fqn]
        if "grid" in t:
            return len(self._grid_chunks(t, [0] * len(t["size"]), list(t["size"])))
        if not self.by_rule:
            return len(t["chunks"])
        return len(self._rule_chunks(fqn, t, (0, t["size"][0])))

    def table_of(self, file: str) -> str:
        """The table (chunks and block digests) of a shard file, format 1 (format 2's chunks name
        their table themselves)."""
        return self.doc["files"][file]

    def global_shapes(self) -> dict[str, tuple[int, ...]]:
        return {fqn: tuple(t["size"]) for fqn, t in self.doc["tensors"].items()}


def _box_wanted(target: torch.Tensor | None, saved: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The box [lo, hi) of the saved tensor that ``target`` covers: a DTensor's local chunk,
    else all of it."""
    chunk_list = getattr(target, "__create_chunk_list__", None)
    if chunk_list is None:
        return [0] * len(saved["size"]), list(saved["size"])
    (chunk,) = chunk_list()
    return list(chunk.offsets), [o + s for o, s in zip(chunk.offsets, chunk.sizes, strict=True)]


def _rows_wanted(target: torch.Tensor | None, saved: dict[str, Any]) -> tuple[int, int]:
    """The rows [lo, hi) of the saved tensor that ``target`` covers: a DTensor's local chunk, else
    all of them."""
    rows = saved["size"][0]
    chunk_list = getattr(target, "__create_chunk_list__", None)
    if chunk_list is None:
        return 0, rows
    (chunk,) = chunk_list()
    lo = chunk.offsets[0] if len(chunk.offsets) else 0
    return lo, lo + (chunk.sizes[0] if len(chunk.sizes) else rows)


class ShardReader(StorageReader):
    """DCP's storage side for a committed sharded checkpoint: byte ranges, verified by block."""

    def __init__(self, store: storage.VerifiedFiles, manifest: storage.Manifest, index: Index):
        super().__init__()
        self.store, self.manifest, self.index = store, manifest, index
        self.bytes_read = 0
        self._storage_data: dict[MetadataIndex, dict[str, Any]] = {}
        self._reports: dict[str, tuple] = {}  # shard file -> (its table, its chunks by fqn)

    def reset(self, checkpoint_id: Any = None) -> None:
        self.bytes_read = 0

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.index.metadata()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *a, **k) -> None:
        self._storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def located(self, plan: LoadPlan):
        """Per shard file: (its name, its table, each request with its chunk's bytes located,
        the byte range of each)."""
        by_file: dict[str, list[tuple[ReadItem, dict[str, Any]]]] = {}
        for req in plan.items:
            chunk = self._storage_data[req.storage_index]
            by_file.setdefault(chunk["file"], []).append((req, chunk))
        for name, reqs in by_file.items():
            table, by_fqn = self._table(name, reqs[0][1].get("table"))
            # Where each chunk's bytes are: in the index (format 1) or in the file's table.
            located = [
                (req, {**by_fqn[c["fqn"]], **c} if "offset" not in c else c) for req, c in reqs
            ]
            yield name, table, located, [_byte_range(req, c) for req, c in located]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        for name, table, located, ranges in self.located(plan):
            views, n = self.store.read_ranges(self.manifest, name, table["blocks"], ranges)
            self.bytes_read += n
            for (req, chunk), byte_range in zip(located, ranges, strict=True):
                source = _as_tensor(views[byte_range], req, chunk)
                target = planner.resolve_tensor(req).detach()
                target.copy_(source)
                planner.commit_tensor(req, target)
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    def _table(
        self, name: str, table_name: str | None
    ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """A shard file's table, read and verified once (a reader may read a tensor at a time)."""
        if name not in self._reports:
            table_name = table_name or self.index.table_of(name)
            table = json.loads(bytes(self.store.read_file(self.manifest, table_name)))
            by_fqn = {
                c["fqn"]: {"offset": c["offset"], "nbytes": c["nbytes"]} for c in table["chunks"]
            }
            self._reports[name] = (table, by_fqn)
        return self._reports[name]


def _byte_range(req: ReadItem, chunk: dict[str, Any]) -> tuple[int, int]:
    """The bytes of the saved chunk that hold ``req``: whole rows of its first dimension (FSDP
    shards on dim 0, so a new shard's slice of an old one is one contiguous range)."""
    sizes = chunk["sizes"]
    if not sizes:
        return chunk["offset"], chunk["offset"] + chunk["nbytes"]
    row = chunk["nbytes"] // sizes[0] if sizes[0] else 0
    first = req.storage_offsets[0]
    start = chunk["offset"] + first * row
    return start, start + req.lengths[0] * row


def _as_tensor(view: memoryview, req: ReadItem, chunk: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, chunk["dtype"])
    sizes = chunk["sizes"]
    shape = [req.lengths[0], *sizes[1:]] if sizes else []
    with warnings.catch_warnings():  # read-only bytes: the tensor is only copied from
        warnings.simplefilter("ignore", UserWarning)
        raw = (
            torch.frombuffer(view, dtype=torch.uint8)
            if len(view)
            else torch.empty(0, dtype=torch.uint8)
        )
    tensor = raw.view(dtype).view(shape)
    for dim in range(1, len(sizes)):
        tensor = tensor.narrow(dim, req.storage_offsets[dim], req.lengths[dim])
    return tensor


def plan_reads(
    reader: ShardReader, targets: dict[str, torch.Tensor]
) -> tuple[LoadPlanner, LoadPlan]:
    """DCP's load planner's requests for ``targets`` (DTensors at this world size, or whole
    tensors) against the checkpoint; nothing is read or collective."""
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    metadata = reader.index.metadata(targets)
    planner.set_up_planner(targets, metadata, True)
    reader.set_up_storage_reader(metadata, True)
    plan = planner.create_local_plan()
    return planner, planner.finish_plan(planner.create_global_plan([plan])[0])


def read_chunks(reader: ShardReader, targets: dict[str, torch.Tensor]) -> None:
    """Fill ``targets`` from the checkpoint, in place, through DCP's load planner."""
    planner, plan = plan_reads(reader, targets)
    reader.read_data(plan, planner).wait()


def read_common(store: storage.VerifiedFiles, manifest: storage.Manifest, map_location: Any):
    """(the index, the unsharded rest of the state) of a committed sharded checkpoint, verified."""
    where = f"step {manifest.step} under {store.safe_url}"
    index = Index.parse(store.read_file(manifest, manifest.metadata["index_file"]), where)
    raw = store.read_file(manifest, index.doc["common"])
    common = tstate.from_bytes(bytearray(raw), map_location=map_location)
    return index, common


def check_fits(state: tstate.TrainState, index: Index, common: dict[str, Any], where: str) -> None:
    """The checks of ``state.check_compatible``, against the saved global shapes."""
    shapes = index.global_shapes()
    metas = {p: torch.empty(s, device="meta") for p, s in shapes.items()}
    tstate.check_compatible(state, join(common, metas), where=where)


def consolidate(
    store: storage.CheckpointStore, manifest: storage.Manifest, map_location: Any = "cpu"
) -> dict[str, Any]:
    """The whole state of a sharded checkpoint in one process, every tensor full size on CPU
    (then ``map_location``); the optimizer keyed by parameter name, as ``get_state_dict`` gives."""
    index, common = read_common(store, manifest, "cpu")
    targets = {
        fqn: torch.empty(t["size"], dtype=getattr(torch, t["dtype"]))
        for fqn, t in index.doc["tensors"].items()
    }
    read_chunks(ShardReader(store, manifest, index), targets)
    if map_location not in (None, "cpu"):
        targets = {k: v.to(map_location) for k, v in targets.items()}
    return join(common, targets)

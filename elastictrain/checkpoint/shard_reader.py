"""Reading a sharded checkpoint back: at any world size, only the bytes needed, every one verified.

DCP's ``DefaultLoadPlanner`` works out from the index (DCP's ``Metadata``, kept as JSON) which slice
of which saved chunk each of this rank's tensors needs; :class:`ShardReader`, a DCP
``StorageReader``, turns each into a byte range of a shard file and reads it through the store,
block-verified. Also: the consolidated whole state in one process, for ``load_checkpoint`` and
``export``. The format is described in :mod:`elastictrain.checkpoint.sharded`.
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
from elastictrain.checkpoint import state as tstate
from elastictrain.checkpoint.sharded import INDEX_FORMAT, capture, join, split
from elastictrain.errors import CheckpointMismatchError


@dataclass(frozen=True)
class Index:
    doc: dict[str, Any]

    @classmethod
    def parse(cls, raw: bytes | memoryview, where: str) -> Index:
        try:
            doc = json.loads(bytes(raw))
            if doc.get("format") != INDEX_FORMAT:
                raise ValueError(f"unsupported index format {doc.get('format')!r}")
        except (ValueError, AttributeError) as e:
            raise storage.CheckpointCorruptError(f"Index of {where} is unreadable: {e}.") from e
        return cls(doc)

    def metadata(self) -> Metadata:
        """DCP's ``Metadata``, so its load planner can compute what each rank reads."""
        state_dict_metadata, storage_data = {}, {}
        for fqn, t in self.doc["tensors"].items():
            chunks = []
            for i, c in enumerate(t["chunks"]):
                chunks.append(
                    ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"]))
                )
                storage_data[MetadataIndex(fqn, torch.Size(c["offsets"]), i)] = {
                    **c,
                    "dtype": t["dtype"],
                }
            state_dict_metadata[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=getattr(torch, t["dtype"])), torch.Size(t["size"]), chunks
            )
        return Metadata(state_dict_metadata=state_dict_metadata, storage_data=storage_data)

    def global_shapes(self) -> dict[str, tuple[int, ...]]:
        return {fqn: tuple(t["size"]) for fqn, t in self.doc["tensors"].items()}


class ShardReader(StorageReader):
    """DCP's storage side for a committed sharded checkpoint: byte ranges, verified by block."""

    def __init__(self, store: storage.CheckpointStore, manifest: storage.Manifest, index: Index):
        super().__init__()
        self.store, self.manifest, self.index = store, manifest, index
        self.bytes_read = 0
        self._storage_data: dict[MetadataIndex, dict[str, Any]] = {}
        self._reports: dict[str, dict[str, Any]] = {}  # shard file -> its part report

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

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        by_file: dict[str, list[tuple[ReadItem, dict[str, Any], tuple[int, int]]]] = {}
        for req in plan.items:
            chunk = self._storage_data[req.storage_index]
            by_file.setdefault(chunk["file"], []).append((req, chunk, _byte_range(req, chunk)))
        for name, reqs in by_file.items():
            if name not in self._reports:  # once per file: a reader may read a tensor at a time
                self._reports[name] = json.loads(
                    bytes(self.store.read_file(self.manifest, self.index.doc["files"][name]))
                )
            report = self._reports[name]
            views, n = self.store.read_ranges(
                self.manifest, name, report["blocks"], [r for _, _, r in reqs]
            )
            self.bytes_read += n
            for req, chunk, byte_range in reqs:
                source = _as_tensor(views[byte_range], req, chunk)
                target = planner.resolve_tensor(req).detach()
                target.copy_(source)
                planner.commit_tensor(req, target)
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done


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


def read_chunks(reader: ShardReader, targets: dict[str, torch.Tensor]) -> None:
    """Fill ``targets`` (DTensors at this world size, or whole tensors) from the checkpoint, in
    place, through DCP's load planner; nothing is collective."""
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    metadata = reader.read_metadata()
    planner.set_up_planner(targets, metadata, True)
    reader.set_up_storage_reader(metadata, True)
    plan = planner.create_local_plan()
    plan = planner.finish_plan(planner.create_global_plan([plan])[0])
    reader.read_data(plan, planner).wait()


def read_common(store: storage.CheckpointStore, manifest: storage.Manifest, map_location: Any):
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


def load_into(
    state: tstate.TrainState,
    store: storage.CheckpointStore,
    manifest: storage.Manifest,
    device: torch.device,
) -> tuple[dict[str, Any], int]:
    """Load a sharded checkpoint into ``state`` at this world size: (the payload, bytes read).
    Raises CheckpointMismatchError before changing anything when it does not fit, and
    CheckpointCorruptError when a byte range this rank reads does not verify."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    where = f"step {manifest.step} under {store.safe_url}"
    index, common = read_common(store, manifest, device)
    check_fits(state, index, common, where)
    targets, _ = split(capture(state, step=0))
    missing = sorted(set(targets) - set(index.doc["tensors"]))
    if missing:
        raise CheckpointMismatchError(
            f"Checkpoint {where} does not fit this run: sharded tensors {missing[:5]} are not in "
            "it. Nothing was deleted. Use the same model, optimizer and Task.state."
        )
    reader = ShardReader(store, manifest, index)
    read_chunks(reader, targets)
    payload = join(common, targets)
    set_state_dict(
        state.model,
        state.optimizer,
        model_state_dict=payload["model"],
        optim_state_dict=payload["optimizer"],
    )
    return payload, reader.bytes_read


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

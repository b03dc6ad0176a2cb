"""Sharded training state (FSDP2): each rank saves its own shards; DCP does the resharding math.

A sharded checkpoint of step N, written by W ranks of generation g:

    step-N/shard-r00000-gg.bin   rank r's local shards, in the flat format of ``staging``,
    step-N/shard-r00001-gg.bin   hashed in 64 KiB blocks (so any byte range verifies alone)
    step-N/part-r0000r-gg.json   rank r's report, once its shard is durable: its chunks and the
                                 shard's block digests (whose SHA-256 is the shard's hash)
    step-N/common-gg.bin         rank 0: everything not sharded (steps, LR, scheduler, buffers)
    step-N/index-gg.json         rank 0: DCP's metadata as JSON (each tensor's global shape, the
                                 chunk each rank wrote, where its bytes are)
    step-N/manifest.json         rank 0, last: every file above, sizes and hashes

Why our own storage under DCP's planner, and not ``dcp.save``/``dcp.load``: DCP's planners own
the hard part (which chunk of which tensor each rank holds, and what overlaps what at another world
size), so we use them: ``DefaultSavePlanner`` describes each rank's chunks and ``DefaultLoadPlanner``
turns the index into read requests at any world size. What DCP's storage layer does not give is what
elastictrain promises: it commits when ``.metadata`` exists with no content hash, it reads whole
saved chunks (a rank at a new world size needs only slices of them), it pickles non-tensor values,
and its saves are collective. Here each rank snapshots into its own reused buffer and writes in the
background with no collective; the commit is rank 0's manifest, listing files every rank reported
durable; each rank reads only the byte ranges its new shards need, each verified by block digest.
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.tensor import DTensor

import storage
from elastictrain.checkpoint import state as tstate
from elastictrain.errors import CheckpointMismatchError

logger = logging.getLogger(__name__)

BLOCK_BYTES = 64 << 10
"""Hash granularity of shard files: a ranged read over-reads at most one block at each end of each
span. Small enough that a rank resuming at another world size reads little it does not need; the
digests (about 1/1000 of the shard as hex) stay in each rank's report."""
INDEX_FORMAT = "elastictrain-sharded/1"
_MARK = "__et_dtensor__"


def shard_file(rank: int, generation: int) -> str:
    return f"shard-r{rank:05d}-g{generation}.bin"


def part_file(rank: int, generation: int) -> str:
    return f"part-r{rank:05d}-g{generation}.json"


def common_file(generation: int) -> str:
    return f"common-g{generation}.bin"


def index_file(generation: int) -> str:
    return f"index-g{generation}.json"


def is_sharded(model: torch.nn.Module) -> bool:
    """A model whose parameters are DTensors (FSDP2's ``fully_shard``) is checkpointed sharded."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def is_sharded_checkpoint(metadata: dict[str, Any]) -> bool:
    return "index_file" in metadata


# -- the state as (sharded tensors, the rest) ---------------------------------------------------
def capture(state: tstate.TrainState, *, step: int) -> dict[str, Any]:
    """Like ``state.capture``, with the model and optimizer as DCP's sharded state dicts (keyed by
    parameter names, so they mean the same at any world size). Nothing is gathered or copied."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
    return tstate.capture(state, step=step, model=model_sd, optimizer=optim_sd)


def split(tree: Any, path: str = "") -> tuple[dict[str, DTensor], Any]:
    """(every DTensor by its path, the tree with each DTensor replaced by a marker)."""
    found: dict[str, DTensor] = {}

    def walk(node: Any, where: str) -> Any:
        if isinstance(node, DTensor):
            found[where] = node
            return {_MARK: where}
        if isinstance(node, dict):
            return type(node)(
                (k, walk(v, f"{where}/{k}" if where else str(k))) for k, v in node.items()
            )
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v, f"{where}/{i}") for i, v in enumerate(node))
        return node

    return found, walk(tree, path)


def join(common: Any, tensors: dict[str, Any]) -> Any:
    """The inverse of :func:`split`: each marker replaced by its tensor."""
    if isinstance(common, dict):
        if len(common) == 1 and _MARK in common:
            return tensors[common[_MARK]]
        return type(common)((k, join(v, tensors)) for k, v in common.items())
    if isinstance(common, (list, tuple)):
        return type(common)(join(v, tensors) for v in common)
    return common


# -- save: what each rank writes --------------------------------------------------------------
@dataclass(frozen=True)
class LocalShards:
    """This rank's chunks: what DCP's save planner says it holds, in the order they are staged."""

    tensors: dict[str, torch.Tensor]
    """Path -> the local shard (a view of the live tensor, copied only by the snapshot)."""
    chunks: list[dict[str, Any]]
    """Per tensor: path, dtype, global size, the chunk's offsets and sizes (DCP's metadata)."""


def local_shards(dtensors: dict[str, DTensor], cache: dict | None = None) -> LocalShards:
    """``cache``: a dict kept across checkpoints; DCP's plan (7 ms for 30 tensors, on the
    training thread) is reused while every tensor keeps its shape and placement."""
    key = tuple(
        (path, tuple(dt.shape), tuple(dt.placements), tuple(dt.to_local().shape), dt.dtype)
        for path, dt in dtensors.items()
    )
    if cache is not None and cache.get("key") == key:
        chunks = cache["chunks"]
        return LocalShards({c["fqn"]: dtensors[c["fqn"]].to_local() for c in chunks}, chunks)
    planned = _plan(dtensors)
    if cache is not None:
        cache.update(key=key, chunks=planned.chunks)
    return planned


def _plan(dtensors: dict[str, DTensor]) -> LocalShards:
    planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    planner.set_up_planner(dtensors, None, False)
    tensors, chunks = {}, []
    for item in planner.create_local_plan().items:
        data = item.tensor_data
        if data is None:  # not a tensor chunk: cannot happen for a dict of DTensors
            raise TypeError(f"unexpected non-tensor item {item.index.fqn} in the sharded state")
        tensor = planner.resolve_data(item)
        tensors[item.index.fqn] = tensor
        chunks.append(
            {
                "fqn": item.index.fqn,
                "dtype": str(data.properties.dtype).removeprefix("torch."),
                "size": list(data.size),
                "offsets": list(data.chunk.offsets),
                "sizes": list(data.chunk.sizes),
            }
        )
    return LocalShards(tensors, chunks)


def part_report(
    shards: LocalShards, offsets: list[tuple[int, int]], file: str, entry: Any, blocks: tuple
) -> bytes:
    """Rank r's report, written once its shard is durable: what the index needs from it."""
    chunks = [
        {**chunk, "file": file, "offset": off, "nbytes": nbytes}
        for chunk, (off, nbytes) in zip(shards.chunks, offsets, strict=True)
    ]
    return json.dumps(
        {
            "file": file,
            "entry": vars(entry),
            "blocks": list(blocks),
            "chunks": chunks,
        }
    ).encode()


def build_index(parts: list[dict[str, Any]], common: str, generation: int) -> bytes:
    """Rank 0 at commit: every rank's chunks merged into one index (DCP's metadata, as JSON)."""
    tensors: dict[str, dict[str, Any]] = {}
    for part in parts:
        for chunk in part["chunks"]:
            entry = tensors.setdefault(
                chunk["fqn"], {"dtype": chunk["dtype"], "size": chunk["size"], "chunks": []}
            )
            entry["chunks"].append(
                {k: chunk[k] for k in ("offsets", "sizes", "file", "offset", "nbytes")}
            )
    # Each shard file's block digests stay in its rank's report (listed in the manifest): a
    # reader fetches only the reports of the files it reads.
    files = {part["file"]: part_file(r, generation) for r, part in enumerate(parts)}
    doc = {"format": INDEX_FORMAT, "common": common, "tensors": tensors, "files": files}
    return json.dumps(doc, separators=(",", ":")).encode()


# -- load: any world size, only the bytes needed ------------------------------------------------
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
            report = json.loads(
                bytes(self.store.read_file(self.manifest, self.index.doc["files"][name]))
            )
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

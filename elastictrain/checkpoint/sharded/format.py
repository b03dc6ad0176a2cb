"""Sharded training state (FSDP2): each rank saves its own shards; DCP does the resharding math.

A sharded checkpoint of step N, written by W ranks of generation g:

    step-N/shard-r00000-gg.bin   rank r's local shards, in the flat format of ``staging``,
    step-N/shard-r00001-gg.bin   hashed in 64 KiB blocks (so any byte range verifies alone)
    step-N/part-r0000r-gg.json   rank r's table: its chunks, where their bytes are, and the
                                 shard's block digests (whose SHA-256 is the shard's hash)
    (receipt)                    rank r, last: both files are durable, their sizes and hashes,
                                 and whether its chunks follow the row rule (below); posted to the
                                 job's c10d store, or step-N/done-r0000r-gg.json (``receipts``)
    step-N/common-gg.bin         rank 0: everything not sharded (steps, LR, scheduler, buffers)
    step-N/index-gg.json         rank 0: each tensor's global shape and how it is split
    step-N/manifest.json         rank 0, last: every file above but a receipt file, sizes and hashes

The index, format 2: FSDP2 splits every tensor by rows over the W ranks as ``torch.chunk`` does
(rank r holds rows [r c, (r + 1) c), c = ceil(n / W)), so a tensor is one line (``"split":
"rows"``) and each rank's chunk is computed, not listed: the index does not grow with W, rank 0
gathers W receipts of ~300 bytes at commit (not W tables), and a rank planning a resume looks only
at the saved chunks its new rows overlap. Format 3 does the same for any regular layout of DTensor
placements (HSDP's replicas, tensor parallelism, FSDP over it): each tensor's mesh shape, which
mesh dimensions split which of its dimensions, and which replica writes it (:mod:`.grid`). A
sharding that neither describes on any rank gets the explicit index of format 1 (every chunk
listed), which rank 0 builds from every rank's table.

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
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.tensor import DTensor

from elastictrain.checkpoint.sharded import grid
from elastictrain.checkpoint.state import dcp
from elastictrain.checkpoint.state import train_state as tstate

logger = logging.getLogger(__name__)

BLOCK_BYTES = 64 << 10
"""Hash granularity of shard files: a ranged read over-reads at most one block at each end of each
span. Small enough that a rank resuming at another world size reads little it does not need; the
digests (about 1/1000 of the shard as hex) stay in each rank's report."""
INDEX_FORMAT = "elastictrain-sharded/1"  # every chunk of every tensor listed
RULE_INDEX_FORMAT = "elastictrain-sharded/2"  # split by the row rule; irregular ones never here
GRID_INDEX_FORMAT = "elastictrain-sharded/3"  # each tensor's placements (``grid``): 2-D, HSDP
_MARK = "__et_dtensor__"


def shard_file(rank: int, generation: int) -> str:
    return f"shard-r{rank:05d}-g{generation}.bin"


def part_file(rank: int, generation: int) -> str:
    return f"part-r{rank:05d}-g{generation}.json"


def receipt_file(rank: int, generation: int) -> str:
    return f"done-r{rank:05d}-g{generation}.json"


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
def capture(state: tstate.TrainState, *, step: int, targets: bool = False) -> dict[str, Any]:
    """Like ``state.capture``, with the model and optimizer as DCP's sharded state dicts (keyed by
    parameter names, so they mean the same at any world size). Nothing is gathered or copied.
    ``targets``: a load's, to read into (``dcp.state_dicts``); else the optimizer is untouched."""
    model_sd, optim_sd = dcp.state_dicts(state.model, state.optimizer, targets=targets)
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
    shared: bool = False
    """Some tensor is replicated along a mesh dimension (HSDP): this rank writes only its share
    of the chunks the replicas hold alike (:func:`written_here`), so the row rule cannot hold."""
    grids: dict[str, grid.Grid] | None = None
    """Every tensor's grid, when this rank's chunks are all the grids' (index format 3)."""

    def follows_row_rule(self, world: int, rank: int) -> bool:
        """Whether the compact index can describe this rank's chunks (:func:`follows_row_rule`)."""
        return not self.shared and follows_row_rule(self.chunks, world, rank)

    def grid_digest(self) -> str | None:
        """The digest of the grids, for the receipt; None when no grid index can describe it."""
        return grid.digest(self.grids) if self.grids is not None else None


def local_shards(
    dtensors: dict[str, DTensor], cache: dict | None = None, every_replica: bool = False
) -> LocalShards:
    """``cache``: a dict kept across checkpoints; DCP's plan (it runs on the training thread:
    docs/measurements.md) is reused while every tensor keeps its shape and placement.
    ``every_replica``: keep the chunks the other replicas write too (the fast tier's copy that
    stands in for its twins' on another node: :func:`twins`)."""
    key = (
        every_replica,
        tuple(
            (path, tuple(dt.shape), tuple(dt.placements), tuple(dt.to_local().shape), dt.dtype)
            for path, dt in dtensors.items()
        ),
    )
    if cache is not None and cache.get("key") == key:
        chunks = cache["chunks"]
        tensors = {c["fqn"]: dtensors[c["fqn"]].to_local() for c in chunks}
        return LocalShards(tensors, chunks, cache["shared"], cache["grids"])
    planned = _plan(dtensors, every_replica)
    if cache is not None:
        cache.update(key=key, chunks=planned.chunks, shared=planned.shared, grids=planned.grids)
    return planned


def _replica(dtensor: DTensor) -> tuple[int, int]:
    """(this rank's replica index, the number of replicas): the rank's coordinate along the mesh
    dimensions the tensor is replicated along (HSDP's replicas); (0, 1) for one not replicated."""
    mesh, replica, replicas = dtensor.device_mesh, 0, 1
    coordinate = mesh.get_coordinate()
    for dim, placement in enumerate(dtensor.placements):
        if placement.is_replicate():
            replica = replica * mesh.size(dim) + coordinate[dim]
            replicas *= mesh.size(dim)
    return replica, replicas


def writers(dtensors: dict[str, DTensor]) -> dict[str, int]:
    """The replica that writes each tensor's chunks. A chunk that R replicas hold alike is
    written once, by one of them; the tensors are dealt to the replicas largest first, each to
    the one with the fewest bytes so far, so each writes about 1/R of the state. Every rank works
    this out alone, from the global shapes and placements (the same everywhere)."""
    chosen, load = {}, {}
    by_size = sorted(dtensors, key=lambda f: -dtensors[f].numel() * dtensors[f].element_size())
    for fqn in by_size:
        dt = dtensors[fqn]
        replicas = _replica(dt)[1]
        loads = load.setdefault(replicas, [0] * replicas)
        chosen[fqn] = min(range(replicas), key=lambda r: loads[r])  # ties: the lowest replica
        loads[chosen[fqn]] += dt.numel() * dt.element_size()
    return chosen


def written_here(dtensors: dict[str, DTensor], dealt: dict[str, int]) -> set[str]:
    """The tensors whose chunk this rank writes: those its replica (its mesh coordinate along
    the replicated dimensions) was ``dealt`` by :func:`writers`."""
    return {f for f, w in dealt.items() if w == _replica(dtensors[f])[0]}


def twins(dtensors: dict[str, DTensor]) -> list[int]:
    """The ranks (this one included) that hold the same chunk of every tensor as this rank: its
    coordinate changed only along mesh dimensions that replicate every tensor (HSDP's replicas of
    one shard position). Just this rank when nothing is replicated."""
    found: set[int] | None = None
    seen: dict[tuple, set[int]] = {}
    for dt in dtensors.values():
        mesh = dt.device_mesh
        replicated = tuple(m for m, p in enumerate(dt.placements) if p.is_replicate())
        key = (id(mesh), replicated)
        if key not in seen:
            coordinate = mesh.get_coordinate()
            where = tuple(slice(None) if m in replicated else c for m, c in enumerate(coordinate))
            seen[key] = {int(r) for r in mesh.mesh[where].flatten().tolist()}
        found = seen[key] if found is None else found & seen[key]
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    return sorted(found) if found else [rank]


def _plan(dtensors: dict[str, DTensor], every_replica: bool = False) -> LocalShards:
    planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    planner.set_up_planner(dtensors, None, False)
    dealt = writers(dtensors)
    mine = set(dtensors) if every_replica else written_here(dtensors, dealt)
    shared = any(_replica(dt)[1] > 1 for dt in dtensors.values())
    tensors, chunks = {}, []
    for item in planner.create_local_plan().items:
        data = item.tensor_data
        if data is None:  # not a tensor chunk: cannot happen for a dict of DTensors
            raise TypeError(f"unexpected non-tensor item {item.index.fqn} in the sharded state")
        if item.index.fqn not in mine:
            continue  # another replica writes the same bytes
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
    return LocalShards(tensors, chunks, shared, _grids(dtensors, dealt, chunks))


def _grids(
    dtensors: dict[str, DTensor], dealt: dict[str, int], chunks: list[dict[str, Any]]
) -> dict[str, grid.Grid] | None:
    """Every tensor's grid, if each has one and this rank's chunks are what its grid gives it."""
    import torch.distributed as dist

    grids = {f: grid.describe(dt, dealt[f]) for f, dt in dtensors.items()}
    if any(g is None for g in grids.values()):
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    for c in chunks:
        coordinate = dtensors[c["fqn"]].device_mesh.get_coordinate()
        if coordinate is None or not grid.holds(grids[c["fqn"]], coordinate, rank, c):
            return None
    return grids


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
            "entry": entry.to_doc(),
            "blocks": list(blocks),
            "chunks": chunks,
        }
    ).encode()


def rows_of(rows: int, world: int, rank: int) -> tuple[int, int]:
    """(first row, row count) of ``rank``'s chunk under the row rule (``torch.chunk``'s, which
    DTensor's ``Shard(0)`` follows)."""
    per = -(-rows // world)
    first = min(rows, rank * per)
    return first, max(0, min(rows, first + per) - first)


def follows_row_rule(chunks: list[dict[str, Any]], world: int, rank: int) -> bool:
    """Whether every chunk of this rank is the row rule's: offsets and sizes computable from the
    global size, W and the rank alone. Checked on every rank at save, so the rule is never assumed."""
    for c in chunks:
        size = c["size"]
        if not size or not size[0]:
            return False
        first, count = rows_of(size[0], world, rank)
        if c["offsets"] != [first, *[0] * (len(size) - 1)] or c["sizes"] != [count, *size[1:]]:
            return False
    return True


def receipt(shard: Any, part: Any, regular: bool, grid_digest: str | None = None) -> bytes:
    """Rank r's receipt, written after its shard and table: what rank 0's commit needs of it
    (whether its chunks follow the row rule, and the digest of its grids if they follow them)."""
    doc = {"shard": shard.to_doc(), "part": part.to_doc(), "regular": regular, "grid": grid_digest}
    return json.dumps(doc).encode()


def build_grid_index(shards: LocalShards, common: str, world: int, generation: int) -> bytes:
    """Rank 0 at commit, when every rank's chunks follow the same grids: one line per tensor."""
    tensors = {
        fqn: {"dtype": g.dtype, "size": list(g.size), "grid": g.to_doc()}
        for fqn, g in shards.grids.items()
    }
    doc = {
        "format": GRID_INDEX_FORMAT,
        "common": common,
        "world": world,
        "generation": generation,
        "tensors": tensors,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def computed_index(
    shards: LocalShards, reports: list[dict[str, Any]], common: str, world: int, generation: int
) -> bytes | None:
    """The one place that picks the compact index, from rank 0's ``shards`` and every rank's
    report (its receipt's ``regular`` and ``grid``): format 2 when every rank follows the row
    rule, format 3 when every rank follows the same grids; None when neither (format 1: every
    chunk listed, from every rank's table)."""
    if all(r["regular"] for r in reports):
        return build_rule_index(shards.chunks, common, world, generation)
    grids = shards.grid_digest()
    if grids is not None and all(r.get("grid") == grids for r in reports):
        return build_grid_index(shards, common, world, generation)
    return None


def build_rule_index(
    chunks: list[dict[str, Any]], common: str, world: int, generation: int
) -> bytes:
    """Rank 0 at commit, when every rank's chunks follow the row rule: one line per tensor, from
    rank 0's own chunks (it holds a chunk of every tensor: the rule gives rank 0 the first rows)."""
    tensors = {c["fqn"]: {"dtype": c["dtype"], "size": c["size"], "split": "rows"} for c in chunks}
    doc = {
        "format": RULE_INDEX_FORMAT,
        "common": common,
        "world": world,
        "generation": generation,
        "tensors": tensors,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


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

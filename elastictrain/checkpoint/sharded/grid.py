"""A regular sharded layout described once per tensor, not once per chunk (index format 3).

Each rank's chunk of a DTensor follows from its placements. Along each tensor dimension, the mesh
dimensions that shard it split it in turn, each as ``torch.chunk`` does: ``Shard(d)`` in mesh
order, and a ``_StridedShard`` (FSDP's over a tensor-parallel ``Shard``) inside the later shards
of the same dimension, which is what its split factor says. Along the mesh dimensions that
replicate it, one replica writes it (``writer``: HSDP's dedup, ``format.writers``). So a
tensor is one line of the index at any W, and a reader computes only the chunks its own overlap.

Every rank checks at save that its chunks are the ones its coordinate gives, and that its rank is
its coordinate's place in the mesh (:func:`holds`); rank 0 writes this index only when every rank
did, with the same description. So the rule is never assumed.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import product
from typing import Any


@dataclass(frozen=True)
class Grid:
    size: tuple[int, ...]
    """The tensor's global shape."""
    dtype: str
    mesh: tuple[int, ...]
    """The mesh's shape; a rank's place in it is its global rank (checked at save)."""
    splits: tuple[tuple[int, tuple[int, ...]], ...]
    """(tensor dimension, the mesh dimensions that split it, outermost first)."""
    replicate: tuple[int, ...]
    """The mesh dimensions it is replicated along."""
    writer: int
    """The replica that writes it: the coordinate along ``replicate``, in mixed radix."""

    def to_doc(self) -> dict[str, Any]:
        return {
            "mesh": list(self.mesh),
            "splits": [[d, list(m)] for d, m in self.splits],
            "replicate": list(self.replicate),
            "writer": self.writer,
        }

    @classmethod
    def from_doc(cls, size: list[int], dtype: str, doc: dict[str, Any]) -> Grid:
        splits = tuple((int(d), tuple(m)) for d, m in doc["splits"])
        return cls(
            tuple(size), dtype, tuple(doc["mesh"]), splits, tuple(doc["replicate"]), doc["writer"]
        )

    def chunk(self, coordinate: list[int]) -> tuple[list[int], list[int]]:
        """(offsets, sizes) of the chunk at mesh ``coordinate``."""
        offsets, sizes = [0] * len(self.size), list(self.size)
        for dim, mesh_dims in self.splits:
            lo, hi = 0, self.size[dim]
            for m in mesh_dims:
                lo, hi = _piece(lo, hi, self.mesh[m], coordinate[m])
            # An empty chunk sits at the dimension's end, where DTensor puts it.
            offsets[dim], sizes[dim] = (lo, hi - lo) if hi > lo else (self.size[dim], 0)
        return offsets, sizes

    def rank_of(self, coordinate: list[int]) -> int:
        rank = 0
        for c, n in zip(coordinate, self.mesh, strict=True):
            rank = rank * n + c
        return rank

    def writers(self) -> dict[int, int]:
        """The writer's coordinate along each replicated mesh dimension."""
        coordinate, rest = {}, self.writer
        for m in reversed(self.replicate):
            rest, coordinate[m] = divmod(rest, self.mesh[m])
        return coordinate

    def within(self, lo: list[int], hi: list[int]) -> Iterator[tuple[int, list[int], list[int]]]:
        """(writing rank, offsets, sizes) of every non-empty saved chunk that overlaps the box
        ``[lo, hi)``: only those are computed, so planning costs the same at any W."""
        fixed = self.writers()
        per_dim = [list(_pieces(self, dim, dims, lo[dim], hi[dim])) for dim, dims in self.splits]
        for combo in product(*per_dim):
            coordinate = [fixed.get(m, 0) for m in range(len(self.mesh))]
            offsets, sizes = [0] * len(self.size), list(self.size)
            for (dim, _), (coords, a, b) in zip(self.splits, combo, strict=True):
                for m, c in coords.items():
                    coordinate[m] = c
                offsets[dim], sizes[dim] = a, b - a
            yield self.rank_of(coordinate), offsets, sizes


def _piece(lo: int, hi: int, n: int, index: int) -> tuple[int, int]:
    """Piece ``index`` of ``[lo, hi)`` cut in ``n`` as ``torch.chunk`` (and ``Shard``) cut it."""
    per = -(-(hi - lo) // n)
    first = min(hi, lo + index * per)
    return first, min(hi, first + per)


def _pieces(grid: Grid, dim: int, mesh_dims: tuple[int, ...], lo: int, hi: int):
    """({mesh dim: coordinate}, start, end) of each non-empty piece of ``dim`` overlapping
    ``[lo, hi)``."""

    def walk(level: int, a: int, b: int, coords: dict[int, int]):
        if level == len(mesh_dims):
            yield coords, a, b
            return
        n = grid.mesh[mesh_dims[level]]
        per = -(-(b - a) // n)
        if per == 0:
            return
        first, last = max(0, (lo - a) // per), min(n - 1, (hi - 1 - a) // per)
        for c in range(first, last + 1):
            s, e = _piece(a, b, n, c)
            if s < e and s < hi and e > lo:
                yield from walk(level + 1, s, e, {**coords, mesh_dims[level]: c})

    yield from walk(0, 0, grid.size[dim], {})


def describe(dtensor: Any, writer: int) -> Grid | None:
    """The grid of ``dtensor``'s placements, or None when no grid describes them (a partial
    placement; a ``_StridedShard`` whose split factor is not the later shards', or that does not
    divide the dimension)."""
    mesh = tuple(dtensor.device_mesh.shape)
    splits: dict[int, list[int]] = {}
    strided, replicate = [], []
    for m, placement in enumerate(dtensor.placements):
        if placement.is_replicate():
            replicate.append(m)
        elif hasattr(placement, "split_factor"):  # _StridedShard: after the later shards
            strided.append((m, placement))
        elif placement.is_shard():
            splits.setdefault(placement.dim, []).append(m)
        else:
            return None
    for m, placement in strided:
        later = [x for x in splits.get(placement.dim, []) if x > m]
        if placement.split_factor != math.prod(mesh[x] for x in later):
            return None
        if dtensor.shape[placement.dim] % placement.split_factor:
            # Uneven: DTensor's strided pieces are not contiguous there; DCP lists them itself.
            return None
        splits.setdefault(placement.dim, []).append(m)
    return Grid(
        tuple(dtensor.shape),
        str(dtensor.dtype).removeprefix("torch."),
        mesh,
        tuple((d, tuple(ms)) for d, ms in sorted(splits.items())),
        tuple(replicate),
        writer,
    )


def holds(grid: Grid, coordinate: list[int], rank: int, chunk: dict[str, Any]) -> bool:
    """Whether this rank's saved ``chunk`` is the one ``grid`` gives its coordinate."""
    offsets, sizes = grid.chunk(coordinate)
    return grid.rank_of(coordinate) == rank and (chunk["offsets"], chunk["sizes"]) == (
        offsets,
        sizes,
    )


def digest(grids: dict[str, Grid]) -> str:
    """One short hash of every tensor's grid: rank 0 writes the grid index only when every
    rank reported the same."""
    doc = {fqn: [list(g.size), g.dtype, g.to_doc()] for fqn, g in sorted(grids.items())}
    return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()[:32]

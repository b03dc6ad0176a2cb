"""checkpoint.sharded.grid: the chunk each mesh coordinate holds, computed from the placements
alone, is DTensor's own (torch's offset math, on plain shapes: no process group needed), for
even and uneven sizes, 1-D to 3-D meshes and FSDP's strided shard over tensor parallelism; and a
reader's box finds exactly the chunks that overlap it."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from elastictrain.checkpoint.sharded import grid

CASES = [
    # (global shape, mesh shape, placements)
    ((10, 7), (4,), (Shard(0),)),
    ((10, 7), (2, 3), (Replicate(), Shard(0))),  # HSDP
    ((10, 7), (2, 2), (Shard(0), Shard(1))),  # FSDP over row-wise TP
    ((10, 7), (2, 2), (_StridedShard(0, split_factor=2), Shard(0))),  # FSDP over column-wise TP
    ((5,), (2, 2), (Shard(0), Replicate())),  # a row-wise layer's bias
    ((14, 3), (2, 3, 2), (Replicate(), _StridedShard(0, split_factor=2), Shard(0))),  # HSDP + TP
    ((3, 9), (2, 4), (Shard(1), Shard(0))),  # uneven: empty chunks
    ((1, 4), (8,), (Shard(0),)),  # most ranks empty
]


def _fake(shape, mesh, placements):
    return SimpleNamespace(
        shape=shape,
        dtype=torch.float32,
        placements=placements,
        device_mesh=SimpleNamespace(shape=mesh),
    )


@pytest.mark.parametrize(("shape", "mesh", "placements"), CASES)
def test_every_coordinates_chunk_is_dtensors_own(shape, mesh, placements):
    g = grid.describe(_fake(shape, mesh, placements), writer=0)
    assert g is not None
    for coordinate in itertools.product(*(range(n) for n in mesh)):
        sizes, offsets = _compute_local_shape_and_global_offset(
            shape, mesh, list(coordinate), placements
        )
        chunk = {"offsets": list(offsets), "sizes": list(sizes)}
        assert grid.holds(g, list(coordinate), g.rank_of(list(coordinate)), chunk), coordinate


@pytest.mark.parametrize(("shape", "mesh", "placements"), CASES)
def test_a_box_finds_exactly_the_written_chunks_that_overlap_it(shape, mesh, placements):
    writer = 1 if any(p.is_replicate() for p in placements) else 0
    g = grid.describe(_fake(shape, mesh, placements), writer=writer)
    written = {}
    for coordinate in itertools.product(*(range(n) for n in mesh)):
        if any(coordinate[m] != c for m, c in g.writers().items()):
            continue  # another replica's copy
        offsets, sizes = g.chunk(list(coordinate))
        if all(sizes):
            written[g.rank_of(list(coordinate))] = (offsets, sizes)
    boxes = [
        ([0] * len(shape), list(shape)),
        ([1] * len(shape), [3] * len(shape)),
        ([shape[0] - 1, 0][: len(shape)], list(shape)),
    ]
    for lo, hi in boxes:
        want = {
            r
            for r, (o, s) in written.items()
            if all(o[d] < hi[d] and o[d] + s[d] > lo[d] for d in range(len(shape)))
        }
        found = {r: (o, s) for r, o, s in g.within(lo, hi)}
        assert set(found) == want, (lo, hi)
        assert all(found[r] == written[r] for r in found)


def test_what_no_grid_describes_is_left_to_the_full_index():
    from torch.distributed.tensor import Partial

    assert grid.describe(_fake((4,), (2,), (Partial(),)), 0) is None
    bad = (_StridedShard(0, split_factor=3), Shard(0))  # not the later shards' product
    assert grid.describe(_fake((12,), (2, 2), bad), 0) is None
    # 13 rows over tp 2 then dp 3: DTensor's strided pieces are not contiguous there.
    uneven = (Replicate(), _StridedShard(0, split_factor=2), Shard(0))
    assert grid.describe(_fake((13, 3), (2, 3, 2), uneven), 0) is None
    g = grid.describe(_fake((10, 7), (2, 2), (Shard(0), Shard(1))), 0)
    assert not grid.holds(g, [0, 1], 1, {"offsets": [0, 0], "sizes": [5, 4]})  # wrong chunk
    assert not grid.holds(g, [0, 1], 2, {"offsets": [0, 4], "sizes": [5, 3]})  # wrong rank
    assert grid.holds(g, [0, 1], 1, {"offsets": [0, 4], "sizes": [5, 3]})

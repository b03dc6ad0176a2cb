"""elastictrain.checkpoint.write.layouts: rank 0's commit gate for sharded checkpoints commits only with
every rank's receipt, and a rank that gave up (or never reports) leaves the step uncommitted
instead of hanging."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

import storage
from elastictrain.checkpoint.sharded import format as sharded
from elastictrain.checkpoint.write.layouts import ShardedLayout


# -- the index: by the row rule when every rank follows it, else every chunk listed -------------
def _save(store, world: int, *, step: int = 5, generation: int = 9, irregular: bool = False):
    """W ranks' shards of 4 tensors of 100-103 rows, split by rows as FSDP2 splits them (rank r's
    rows hold 100 r + tensor number), each rank's write, then rank 0's commit. ``irregular``
    moves one row of the first tensor from the last rank to the one before: a complete split
    that is not the rule's."""
    from elastictrain.checkpoint.state.flat import Staging
    from elastictrain.checkpoint.write.layouts import ShardSnap

    sizes = {f"model/w{i}": [100 + i, 3] for i in range(4)}
    snaps = []
    for rank in range(world):
        tensors, chunks = {}, []
        for i, (fqn, size) in enumerate(sizes.items()):
            first, count = sharded.rows_of(size[0], world, rank)
            if not count:
                continue
            if irregular and i == 0 and rank >= world - 2:
                first, count = (first, count + 1) if rank == world - 2 else (first + 1, count - 1)
            tensors[fqn] = torch.full((count, 3), float(100 * rank + i))
            chunks.append({"fqn": fqn, "dtype": "float32", "size": size,
                           "offsets": [first, 0], "sizes": [count, 3]})  # fmt: skip
        snap = ShardSnap(sharded.LocalShards(tensors, chunks), Staging().snapshot(tensors),
                         Staging().snapshot({"step": step}) if rank == 0 else None)  # fmt: skip
        ShardedLayout(rank, world).write_own(store, step, snap, generation)
        snaps.append(snap)
    return ShardedLayout(0, world).commit(
        store,
        step,
        snaps[0],
        generation,
        {},
        before_commit=lambda: None,
        abandoned=lambda s: False,
        deadline_s=10,
    )


def _whole(store, manifest) -> dict[str, torch.Tensor]:
    """Every saved tensor, whole, read through the reader the runner uses (ranges, verified)."""
    from elastictrain.checkpoint.sharded import reader as shard_reader

    index, _ = shard_reader.read_common(store, manifest, "cpu")
    targets = {f[len("model/") :]: torch.empty(t["size"]) for f, t in index.doc["tensors"].items()}
    reader = shard_reader.ShardReader(store, manifest, index)
    shard_reader.read_chunks(reader, {f"model/{k}": v for k, v in targets.items()})
    return targets


def test_a_regular_split_commits_an_index_that_does_not_grow_with_w_and_reads_back_exactly(
    tmp_path,
):

    index_bytes = {}
    for world in (4, 32):
        store = storage.open_store(f"memory://layouts-{world}-{time.monotonic_ns()}")
        manifest = _save(store, world)
        raw = store.read_file(manifest, manifest.metadata["index_file"])
        assert json.loads(raw)["format"] == sharded.RULE_INDEX_FORMAT
        index_bytes[world] = len(raw)
        whole = _whole(store, manifest)
        for i in range(4):
            rows = whole[f"w{i}"]
            owner = [sharded.rows_of(rows.shape[0], world, r) for r in range(world)]
            want = torch.cat([torch.full((n, 3), float(100 * r + i)) for r, (_, n) in
                              enumerate(owner)])  # fmt: skip
            assert torch.equal(rows, want), (world, i)
    # One line per tensor, whatever W: only the digits of "world" differ.
    assert index_bytes[32] - index_bytes[4] == 1, index_bytes


def test_a_rank_resuming_at_another_world_size_plans_only_the_chunks_its_rows_overlap(tmp_path):
    from elastictrain.checkpoint.sharded import reader as shard_reader

    store = storage.open_store(str(tmp_path / "c"))
    manifest = _save(store, 32)
    index = shard_reader.Index.parse(store.read_file(manifest, manifest.metadata["index_file"]), "")

    class Rows(torch.Tensor):  # what a DTensor tells DCP about its local chunk: rows 16..31
        pass

    target = torch.empty(16, 3)
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    target.__create_chunk_list__ = lambda: [ChunkStorageMetadata(torch.Size([16, 0]),
                                                                 torch.Size([16, 3]))]  # fmt: skip
    md = index.metadata({"model/w0": target})
    assert list(md.state_dict_metadata) == ["model/w0"]
    saved = md.state_dict_metadata["model/w0"].chunks
    assert [c.offsets[0] for c in saved] == [16, 20, 24, 28]  # 4 rows a rank: 4 of 32 ranks


def test_an_irregular_split_on_any_rank_gets_every_chunk_listed_and_still_reads_exactly(tmp_path):

    store = storage.open_store(str(tmp_path / "c"))
    manifest = _save(store, 4, irregular=True)
    doc = json.loads(store.read_file(manifest, manifest.metadata["index_file"]))
    assert doc["format"] == sharded.INDEX_FORMAT
    assert [c["offsets"][0] for c in doc["tensors"]["model/w0"]["chunks"]] == [0, 25, 50, 76]
    w0 = _whole(store, manifest)["w0"]
    assert torch.equal(w0[50:76], torch.full((26, 3), 200.0))
    assert torch.equal(w0[76:], torch.full((24, 3), 300.0))


def _save_hsdp(
    store, *, disagree: bool = False, step: int = 5, dies: int | None = None, deadline_s=10.0
):
    """HSDP 2 x 2 (4 ranks): 4 tensors of 9 rows, rows over the 2 shards, each tensor written by
    the replica it is dealt (``grid.writer``): rank (replica q, shard s) writes what its grid
    gives it (value 10 s + tensor number). ``disagree``: the last rank reports no grids (as a
    rank with another layout would), so rank 0 must list every chunk. ``dies``: that rank is
    killed mid-write (half its shard file on storage, no table, no receipt)."""
    from elastictrain.checkpoint.sharded.grid import Grid
    from elastictrain.checkpoint.state.flat import Staging
    from elastictrain.checkpoint.write.layouts import ShardSnap

    grids = {
        f"model/w{i}": Grid((9, 3), "float32", (2, 2), ((0, (1,)),), (0,), i % 2) for i in range(4)
    }
    snaps = []
    for rank in range(4):
        coordinate, tensors, chunks = [rank // 2, rank % 2], {}, []
        for i, (fqn, g) in enumerate(grids.items()):
            if g.writer != coordinate[0]:
                continue  # the other replica writes it
            offsets, sizes = g.chunk(coordinate)
            tensors[fqn] = torch.full(sizes, float(10 * coordinate[1] + i))
            chunks.append(
                {"fqn": fqn, "dtype": "float32", "size": [9, 3], "offsets": offsets, "sizes": sizes}
            )
        mine = None if disagree and rank == 3 else grids
        snap = ShardSnap(
            sharded.LocalShards(tensors, chunks, True, mine),
            Staging().snapshot(tensors),
            Staging().snapshot({"step": step}) if rank == 0 else None,
        )
        if rank == dies:
            torn = store.url + f"/step-{step:012d}/" + sharded.shard_file(rank, 9)
            os.makedirs(os.path.dirname(torn), exist_ok=True)
            with open(torn, "wb") as f:
                f.write(bytes(snap.shards.data)[: len(snap.shards.data) // 2])
        else:
            ShardedLayout(rank, 4).write_own(store, step, snap, 9)
        snaps.append(snap)
    return ShardedLayout(0, 4).commit(
        store,
        step,
        snaps[0],
        9,
        {},
        before_commit=lambda: None,
        abandoned=lambda s: False,
        deadline_s=deadline_s,
    )


@pytest.mark.parametrize("disagree", [False, True], ids=["same-grids", "one-rank-differs"])
def test_hsdp_grids_commit_one_line_per_tensor_only_when_every_rank_reports_the_same(
    tmp_path, disagree
):
    store = storage.open_store(str(tmp_path / "c"))
    manifest = _save_hsdp(store, disagree=disagree)
    doc = json.loads(store.read_file(manifest, manifest.metadata["index_file"]))
    assert doc["format"] == (sharded.INDEX_FORMAT if disagree else sharded.GRID_INDEX_FORMAT)
    whole = _whole(store, manifest)
    for i in range(4):  # rows 0-4 from shard 0, 5-8 from shard 1, whichever replica wrote them
        want = torch.cat([torch.full((5, 3), float(i)), torch.full((4, 3), float(10 + i))])
        assert torch.equal(whole[f"w{i}"], want), i


def test_hsdp_commits_nothing_when_a_rank_dies_mid_write_and_fences_a_stale_writer(tmp_path):
    """The commit gate on the 2-D layouts: rank 3 (replica 1, which writes half the tensors) is
    killed mid-write, so rank 0 never gets its receipt and commits nothing; and an attempt whose
    generation a newer one has fenced off cannot commit. The committed step stays as it was."""
    from elastictrain.checkpoint.write.receipts import ShardsMissingError

    store = storage.open_store(str(tmp_path / "c"))
    _save_hsdp(store)  # step 5, generation 9
    with pytest.raises(ShardsMissingError, match=r"rank\(s\) \[3\]"):
        _save_hsdp(store, step=6, dies=3, deadline_s=0.5)
    store.advance_fence(10)  # a newer attempt claimed the location
    with pytest.raises(storage.StaleWriterError):
        _save_hsdp(store, step=7)
    assert [m.step for m in store.ranked_manifests()] == [5]
    whole = _whole(store, store.read_manifest(5))
    for i in range(4):
        want = torch.cat([torch.full((5, 3), float(i)), torch.full((4, 3), float(10 + i))])
        assert torch.equal(whole[f"w{i}"], want), i


def test_a_shard_table_with_a_bad_digest_is_refused_before_any_range_is_trusted(tmp_path):

    store = storage.open_store(str(tmp_path / "c"))
    manifest = _save(store, 4)
    table = tmp_path / "c" / "step-000000000005" / sharded.part_file(2, 9)
    doc = json.loads(table.read_text())
    doc["blocks"][0] = "0" * len(doc["blocks"][0])  # a digest that would accept other bytes
    table.write_text(json.dumps(doc))
    with pytest.raises(storage.CheckpointCorruptError):
        _whole(store, manifest)

"""Durable reads shared by the ranks that want the same bytes (HSDP's replicas), on 4 spawned
gloo processes: twins {0, 2} and {1, 3} each read about half of what they need and swap, every
range arrives byte for byte; a twin whose share does not verify makes both twins raise, and the
other pair is untouched; a rank that could not plan shares with no one."""

from __future__ import annotations

import traceback
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import storage
from elastictrain.checkpoint.resume import shared_reads
from tests.helpers.net import free_port

BLOCK = 1 << 10
DATA = bytes((i * 7 + i // 251) % 256 for i in range(40 * BLOCK))
# What each pair wants of the file: ranges that start and end inside blocks.
WANTED = {0: ((100, 9000), (9000, 20500)), 1: ((20500, 30000), (31000, 40 * BLOCK - 3))}


class FailsOnce:
    """The store, except that this rank's reads do not verify."""

    def __init__(self, store):
        self.store, self.safe_url = store, store.safe_url

    def read_file(self, manifest, name):
        return self.store.read_file(manifest, name)

    def read_ranges(self, manifest, name, blocks, ranges):
        raise storage.CheckpointCorruptError(f"{name}: block 3 does not match")


MODES = ("ok", "corrupt", "unplanned")


def _worker(rank: int, world: int, port: int, folder: str, blocks, out) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=30))
        timeout = timedelta(seconds=30)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        ckpt = storage.open_store(folder)
        manifest = ckpt.read_manifest(1)
        for mode in MODES:  # one group for all three: spawning costs more than the test
            out.put((mode, rank, *_fetch(ckpt, manifest, blocks, mode, rank)))
    except Exception:
        out.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _fetch(ckpt, manifest, blocks, mode: str, rank: int) -> tuple:
    wanted = {"shard": (blocks, WANTED[rank % 2])}
    if mode == "unplanned" and rank == 3:
        wanted = None
    reads = FailsOnce(ckpt) if mode == "corrupt" and rank == 2 else ckpt
    try:
        got = shared_reads.fetch(reads, manifest, wanted, group=dist.group.WORLD, rank=rank)
    except storage.CheckpointCorruptError as e:
        return ("corrupt", str(e))
    ranges = {}
    if wanted is not None:
        # Through the store interface the reader uses: every planned range, exact.
        views, _ = got.read_ranges(manifest, "shard", blocks, list(WANTED[rank % 2]))
        ranges = {r: bytes(v) == DATA[r[0] : r[1]] for r, v in views.items()}
    return (got.twins, got.bytes_read, ranges)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict[int, tuple]]:
    folder = str(tmp_path_factory.mktemp("shared") / "ckpt")
    ckpt = storage.open_store(folder)
    entry, digest = ckpt.write_file(1, "shard", DATA, BLOCK)
    ckpt.commit_written(1, {"shard": entry}, {})
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    args = (4, port, folder, list(digest.blocks), out)
    procs = [ctx.Process(target=_worker, args=(r, *args)) for r in range(4)]
    for p in procs:
        p.start()
    got: dict[str, dict[int, tuple]] = {}
    try:
        for _ in range(4 * len(MODES)):
            mode, rank, *rest = out.get(timeout=120)
            assert mode != "error", rest[0]
            got.setdefault(mode, {})[rank] = tuple(rest)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return got


def _needed(pair: int) -> int:
    return sum(hi - lo for lo, hi in WANTED[pair])


def test_twins_each_read_about_half_and_every_range_arrives_exactly(results):
    results = results["ok"]
    for rank, (twins, bytes_read, ranges) in results.items():
        assert twins == [rank % 2, rank % 2 + 2]
        assert ranges and all(ranges.values()), (rank, ranges)
        # Whole blocks are read: a share is half the need, within a block at each end.
        assert abs(bytes_read - _needed(rank % 2) / 2) <= 2 * BLOCK, (rank, bytes_read)
    for pair in (0, 1):
        together = results[pair][1] + results[pair + 2][1]
        assert together <= _needed(pair) + 2 * BLOCK  # each block once, not twice


def test_a_share_that_does_not_verify_fails_both_twins_and_leaves_the_other_pair_alone(results):
    results = results["corrupt"]
    assert results[2][0] == "corrupt" and "block 3 does not match" in results[2][1]
    assert results[0][0] == "corrupt" and "rank(s) [2]" in results[0][1], results[0]
    for rank in (1, 3):
        assert results[rank][0] == [1, 3] and all(results[rank][2].values()), results[rank]


def test_a_rank_that_could_not_plan_shares_with_no_one(results):
    results = results["unplanned"]
    assert results[3][0] == [] and results[3][1] == 0
    assert results[1][0] == [1] and results[1][1] >= _needed(1), results[1]
    assert all(results[1][2].values())
    assert results[0][0] == [0, 2]

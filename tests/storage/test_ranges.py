"""Block-hashed files: ranged reads verified block by block, on every backend, and what they cost."""

from __future__ import annotations

import os

import pytest

from storage import CheckpointCorruptError, open_store
from storage.ranges import spans_for

BLOCK = 1024


@pytest.fixture
def store(store_location):
    url, options = store_location
    return open_store(url, storage_options=options)


def _committed(store, data: bytes):
    entry, digest = store.write_file(1, "shard.bin", data, BLOCK)
    manifest = store.commit_written(1, {"shard.bin": entry}, {})
    return manifest, list(digest.blocks)


def test_spans_widen_to_blocks_and_merge_neighbours():
    assert spans_for([(10, 20)], 100, 1000)[0].start == 0
    # Two ranges in touching blocks are one read; a gap of a whole block keeps them apart.
    assert [(s.start, s.end) for s in spans_for([(10, 150), (210, 220)], 100, 1000)] == [(0, 300)]
    assert [(s.start, s.end) for s in spans_for([(10, 20), (310, 320)], 100, 1000)] == [
        (0, 100),
        (300, 400),
    ]
    assert spans_for([(950, 1000)], 100, 990)[-1].end == 990  # never past the file's end


def test_ranged_read_returns_exactly_the_bytes_and_reads_little_more(store):
    data = os.urandom(64 * BLOCK)
    manifest, blocks = _committed(store, data)
    ranges = [(5000, 9000), (40000, 40010)]
    views, read = store.read_ranges(manifest, "shard.bin", blocks, ranges)
    for start, end in ranges:
        assert bytes(views[(start, end)]) == data[start:end]
    assert read <= sum(e - s for s, e in ranges) + 2 * BLOCK * len(ranges)
    assert read < len(data) / 4


def test_a_flipped_byte_in_a_range_read_is_corruption_and_elsewhere_is_not_read(store, tmp_path):
    if not store.url.startswith("/"):
        pytest.skip("flips the file in place on local disk")
    data = bytearray(os.urandom(16 * BLOCK))
    manifest, blocks = _committed(store, bytes(data))
    path = os.path.join(store.url, "step-000000000001", "shard.bin")
    with open(path, "r+b") as f:
        f.seek(10 * BLOCK + 7)
        f.write(bytes([data[10 * BLOCK + 7] ^ 1]))
    views, _ = store.read_ranges(manifest, "shard.bin", blocks, [(0, 2 * BLOCK)])
    assert bytes(views[(0, 2 * BLOCK)]) == bytes(data[: 2 * BLOCK])
    with pytest.raises(CheckpointCorruptError, match="block 10 .* does not match its digest"):
        store.read_ranges(manifest, "shard.bin", blocks, [(10 * BLOCK, 10 * BLOCK + 8)])
    with pytest.raises(CheckpointCorruptError, match="corrupted"):
        store.read(1)  # the whole-file check sees it too


def test_digests_that_do_not_match_the_recorded_hash_are_refused(store):
    manifest, blocks = _committed(store, os.urandom(8 * BLOCK))
    forged = [blocks[1], *blocks[1:]]
    with pytest.raises(CheckpointCorruptError, match="do not match its recorded hash"):
        store.read_ranges(manifest, "shard.bin", forged, [(0, 10)])

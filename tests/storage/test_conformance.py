"""Every implementation of the store contracts (``storage.api``) keeps them: the store on each
backend (local, memory://, S3 over moto), the throttled stand-in for a slow remote, and the fast
tier's ``FetchedFiles``, which serves bytes fetched from node memory to the same sharded reader.

``isinstance`` against a ``runtime_checkable`` Protocol checks only that the names exist; the
behaviour each method's docstring promises is checked here, on each implementation."""

from __future__ import annotations

import os

import pytest

import storage
from elastictrain.checkpoint.resume.fast_copies import FetchedFiles

BLOCK = 1024


@pytest.fixture(params=["backend", "throttled"])
def store(request, store_location, tmp_path, monkeypatch):
    if request.param == "throttled":
        if store_location[0].startswith(("memory://", "s3://")):
            pytest.skip("the throttled stand-in wraps a local folder")
        import elastictrain.bench.throttled_fs  # noqa: F401  registers throttled://

        monkeypatch.setenv("ET_THROTTLE_BPS", str(1e9))
        return storage.open_store(f"throttled://{tmp_path / 'slow'}")
    url, options = store_location
    return storage.open_store(url, storage_options=options)


def test_a_store_is_a_store_by_its_names_and_its_behaviour(store):
    assert isinstance(store, storage.Store) and isinstance(store, storage.VerifiedFiles)
    assert store.read_fence() == 0 and store.advance_fence(3) == 3 and store.read_fence() == 3
    data = os.urandom(8 * BLOCK)
    entry, digest = store.write_file(5, "shard.bin", data, BLOCK)
    store.write_note(5, "note", b"receipt")
    assert store.read_uncommitted(5, "note") == b"receipt" and not store.is_committed(5)
    assert {"shard.bin", "note"} <= store.names_in(5)
    manifest = store.commit_written(5, {"shard.bin": entry}, {"k": 1}, generation=3)
    assert store.is_committed(5) and store.committed_steps() == [5]
    assert store.read_manifest(5) == manifest and store.ranked_manifests() == [manifest]
    store.check_sizes(manifest)
    assert bytes(store.read_file(manifest, "shard.bin")) == data
    views, read = store.read_ranges(manifest, "shard.bin", list(digest.blocks), [(10, 20)])
    assert bytes(views[(10, 20)]) == data[10:20] and BLOCK <= read < len(data)
    flat = store.commit(6, {"state.bin": b"x" * 100}, {}, generation=3)
    assert bytes(store.read_file(flat, "state.bin")) == b"x" * 100
    store.uncommit(6)
    assert store.read_manifest(6) is None and store.committed_steps() == [5]
    store.delete(5)
    assert store.read_manifest(5) is None and store.apply_retention(1, newest_good=5) == []


def test_the_fast_tiers_fetched_files_read_as_the_store_they_came_from(store):
    """What ``shard_fetch`` fetched from node memory reads exactly as the store would: the sharded
    reader cannot tell them apart."""
    data = os.urandom(8 * BLOCK)
    entry, digest = store.write_file(1, "shard.bin", data, BLOCK)
    manifest = store.commit_written(1, {"shard.bin": entry}, {})
    fetched = FetchedFiles()
    assert isinstance(fetched, storage.VerifiedFiles) and not isinstance(fetched, storage.Store)
    fetched.files["shard.bin"] = store.read_file(manifest, "shard.bin")
    ranges = [(0, 5), (BLOCK + 3, 3 * BLOCK)]
    views, _ = store.read_ranges(manifest, "shard.bin", list(digest.blocks), ranges)
    for r in ranges:
        fetched.ranges[("shard.bin", r)] = views[r]
    assert bytes(fetched.read_file(manifest, "shard.bin")) == data
    got, nbytes = fetched.read_ranges(manifest, "shard.bin", list(digest.blocks), ranges)
    assert {r: bytes(v) for r, v in got.items()} == {r: data[r[0] : r[1]] for r in ranges}
    assert nbytes == sum(hi - lo for lo, hi in ranges)

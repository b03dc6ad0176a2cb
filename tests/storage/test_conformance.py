"""Every implementation of the store contracts (``storage.api``) keeps them: the store on each
backend (local, memory://, S3 over moto), the throttled stand-in for a slow remote, and the fast
tier's ``FetchedFiles``, which serves bytes fetched from node memory to the same sharded reader.

``isinstance`` against a ``runtime_checkable`` Protocol checks only that the names exist; the
behaviour each method's docstring promises is checked here, on each implementation."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

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


def test_a_checkpoint_file_is_written_once_and_never_again(store):
    """Write-once (docs/checkpoints.md): payload files, notes and manifests are created, never
    opened for writing again. The same bytes again are success (a retry whose first try
    landed); other bytes raise FileConflictError and leave the file as it was; a committed step
    refuses a second manifest, even of its own generation; an older generation's manifest is
    replaced only when asked, the new one published over it before the old one's files go."""
    data = os.urandom(4 * BLOCK)
    entry, _ = store.write_file(7, "shard-g1.bin", data, BLOCK)
    assert store.write_file(7, "shard-g1.bin", data, BLOCK)[0] == entry
    for other in (os.urandom(4 * BLOCK), data[:-1]):  # other bytes; another size
        with pytest.raises(
            storage.FileConflictError, match="shard-g1.bin.*nothing was overwritten"
        ):
            store.write_file(7, "shard-g1.bin", other, BLOCK)
    store.write_note(7, "note", b"receipt")
    store.write_note(7, "note", b"receipt")
    with pytest.raises(storage.FileConflictError, match="note"):
        store.write_note(7, "note", b"another receipt")
    assert store.read_uncommitted(7, "note") == b"receipt"
    first = store.commit_written(7, {"shard-g1.bin": entry}, {}, generation=1)
    for replace_older in (False, True):
        with pytest.raises(storage.CheckpointExistsError, match="by generation 1"):
            store.commit_written(
                7, {"shard-g1.bin": entry}, {"again": 1}, 1, replace_older=replace_older
            )
    assert store.read_manifest(7) == first and bytes(store.read_file(first, "shard-g1.bin")) == data

    newer, _ = store.write_file(7, "shard-g2.bin", data[::-1], BLOCK)
    with pytest.raises(storage.CheckpointExistsError):
        store.commit_written(7, {"shard-g2.bin": newer}, {}, generation=2)
    assert store.read_manifest(7) == first
    second = store.commit_written(7, {"shard-g2.bin": newer}, {}, 2, replace_older=True)
    assert (
        store.read_manifest(7) == second
        and bytes(store.read_file(second, "shard-g2.bin")) == data[::-1]
    )
    assert store.names_in(7) == {"shard-g2.bin", "note", "manifest.json"}  # no temporary left


def test_a_write_whose_reply_was_lost_is_retried_to_success(store, monkeypatch):
    """The request lands, its answer does not (a timeout): the retry finds the name taken by the
    very bytes it sends, which is success, for a payload file and for the manifest alike."""
    create, lost = store._backend.create, []

    def lands_then_times_out(path, data):
        created = create(path, data)
        if not lost or lost[-1] != path:
            lost.append(path)
            raise ConnectionResetError("the reply was lost")
        return created

    monkeypatch.setattr(store._backend, "create", lands_then_times_out)
    manifest = store.commit(3, {"state-g1.bin": b"x" * 100}, {}, generation=1)
    assert len(lost) == 2 and store.read(3).manifest == manifest  # the file, then the manifest


def test_each_backend_states_what_its_create_guarantees(store):
    """docs/checkpoints.md's table: "atomic" where the filesystem itself refuses a taken name (a
    hard link locally, S3's If-None-Match), "checked" where the backend looks first (memory://,
    fsspec's default, the throttled stand-in). Where it is atomic, of writers racing for one name
    exactly one creates it, and the name holds its bytes."""
    expected = {"local": "atomic", "s3": "atomic", "memory": "checked", "throttled": "checked"}
    url = store.url
    kind = (
        next(k for k in ("throttled", "memory", "s3") if url.startswith(f"{k}://"))
        if "://" in url
        else "local"
    )
    assert store._backend.create_guarantee == expected[kind]
    if expected[kind] != "atomic":
        return
    path = store._backend.join(store._backend.root, "step-000000000001", "raced.bin")
    payloads = [bytes([i]) * 4096 for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(lambda data: store._backend.create(path, data), payloads))
    assert won.count(True) == 1
    assert store._backend.read(path) == payloads[won.index(True)]

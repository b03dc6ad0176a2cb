"""The storage contract, run against local disk, memory:// and a real S3 endpoint."""

from __future__ import annotations

import logging

import pytest

from storage import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    open_store,
)
from storage.manifest import MANIFEST_NAME, step_dir_name


@pytest.fixture
def store(store_location):
    url, options = store_location
    return open_store(url, storage_options=options)


def _commit(store, step, payload=None):
    payload = payload if payload is not None else f"payload-{step}".encode() * 10
    return store.commit(
        step, {"state.pt": payload, "extra.bin": b"x" * step}, {"epoch": 0, "step": step}
    )


def _overwrite(store, step, name, data):
    """Damage a committed file behind the store's back (bit rot, a tampering tool)."""
    backend = store._backend
    backend.write_atomic(backend.join(backend.root, step_dir_name(step), name), data)


def test_empty_store_has_no_latest(store):
    assert store.latest() is None
    assert store.committed_steps() == []


def test_commit_roundtrip(store):
    manifest = _commit(store, 5)
    assert manifest.step == 5
    assert manifest.files["state.pt"].size == len(b"payload-5" * 10)
    got = store.read(5)
    assert got.files["state.pt"] == b"payload-5" * 10
    assert got.files["extra.bin"] == b"x" * 5
    assert got.manifest.metadata == {"epoch": 0, "step": 5}
    assert got.manifest.total_bytes == 95


def test_a_veto_right_before_the_commit_point_leaves_the_step_uncommitted(store):
    """The writer's last check (an orphaned rank 0 must not commit) runs after the payload is
    written, immediately before the manifest: its error aborts the commit."""

    class Orphaned(Exception):
        pass

    def veto():
        raise Orphaned

    with pytest.raises(Orphaned):
        store.commit(3, {"state.pt": b"x" * 100}, {"step": 3}, before_commit=veto)
    assert not store.is_committed(3) and store.latest() is None
    store.commit(3, {"state.pt": b"x" * 100}, {"step": 3}, before_commit=lambda: None)
    assert store.is_committed(3)


def test_payload_without_manifest_does_not_exist(store):
    _commit(store, 1)
    _overwrite(store, 2, "state.pt", b"half-written")  # a writer that died before committing
    assert store.committed_steps() == [1]
    assert store.latest().manifest.step == 1
    with pytest.raises(CheckpointNotFoundError):
        store.read(2)


def test_latest_is_newest(store):
    for step in (3, 10, 7):
        _commit(store, step)
    assert store.latest().manifest.step == 10
    assert [c.step for c in store.list()] == [3, 7, 10]


def test_committed_checkpoint_is_never_overwritten(store):
    _commit(store, 4)
    with pytest.raises(CheckpointExistsError):
        _commit(store, 4, payload=b"other")
    assert store.read(4).files["state.pt"] == b"payload-4" * 10


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing_manifest_json"])
def test_latest_falls_back_past_corruption(store, damage, caplog):
    _commit(store, 1)
    _commit(store, 2)
    good = store.read(2).files["state.pt"]
    if damage == "flip":
        _overwrite(store, 2, "state.pt", bytes([good[0] ^ 0xFF]) + good[1:])
    elif damage == "truncate":
        _overwrite(store, 2, "state.pt", good[: len(good) // 2])
    else:
        _overwrite(store, 2, MANIFEST_NAME, b"{not json")
    with caplog.at_level(logging.ERROR, logger="storage.store"):
        latest = store.latest()
    assert latest.manifest.step == 1
    assert "CORRUPT CHECKPOINT" in caplog.text
    with pytest.raises(CheckpointCorruptError):
        store.read(2)
    listed = {c.step: c for c in store.list()}
    assert listed[1].ok and not listed[2].ok


@pytest.mark.parametrize("damage", ["none", "truncate", "extend", "flip"])
def test_big_payloads_are_hashed_while_streamed(store, damage):
    """Payloads from 8 MB on take the pipelined write/read path; it must verify the same way."""
    import os as _os

    big = _os.urandom(9 << 20)
    store.commit(3, {"state.bin": memoryview(big)}, {"step": 3})
    if damage == "truncate":
        _overwrite(store, 3, "state.bin", big[:-1])
    elif damage == "extend":
        _overwrite(store, 3, "state.bin", big + b"x")
    elif damage == "flip":
        _overwrite(store, 3, "state.bin", big[:100] + bytes([big[100] ^ 1]) + big[101:])
    if damage == "none":
        data = store.read(3).files["state.bin"]
        assert data == big and not memoryview(data).readonly  # tensors may be views into it
    else:
        with pytest.raises(CheckpointCorruptError, match="twice"):
            store.read(3)


@pytest.mark.parametrize("checksum", ["xxh3", "sha256"])
def test_each_checksum_is_recorded_verifies_and_catches_a_flip(store_location, checksum):
    """The algorithm is named in the manifest, so a store hashing with another one (the default
    changed from sha256 to xxh3) still verifies every older checkpoint, big and small."""
    import hashlib
    import json
    import os as _os

    url, options = store_location
    writer = open_store(url, storage_options=options, checksum=checksum)
    big, small = _os.urandom(9 << 20), b"small payload"
    writer.commit(1, {"state.bin": memoryview(big), "extra.bin": small}, {"step": 1})
    raw = json.loads(writer._backend.read(_path(writer, 1, MANIFEST_NAME)))
    assert raw["checksum_algorithm"] == checksum
    assert raw["files"]["extra.bin"] == {"size": len(small), checksum: _hex(small, checksum)}
    other = "sha256" if checksum == "xxh3" else "xxh3"
    reader = open_store(url, storage_options=options, checksum=other)
    assert reader.read(1).files["state.bin"] == big
    _overwrite(writer, 1, "extra.bin", b"smaLl payload")
    with pytest.raises(CheckpointCorruptError, match=f"{checksum} .* does not match"):
        reader.read(1)
    # A manifest exactly as the sha256-only format wrote it still verifies.
    legacy = {
        "format_version": 1,
        "step": 2,
        "generation": 0,
        "created_at": 0.0,
        "metadata": {},
        "checksum_algorithm": "sha256",
        "files": {
            "a.bin": {"size": 3, "sha256": hashlib.sha256(b"abc").hexdigest(), "block_size": 0}
        },
    }
    _overwrite(writer, 2, "a.bin", b"abc")
    _overwrite(writer, 2, MANIFEST_NAME, json.dumps(legacy).encode())
    assert open_store(url, storage_options=options).read(2).files["a.bin"] == b"abc"


def _path(store, step, name):
    return store._backend.join(store._backend.root, step_dir_name(step), name)


def _hex(data, algorithm):
    from storage.hashing import hex_digest

    return hex_digest(data, algorithm)


def test_a_flaky_read_is_not_called_corruption(store, monkeypatch, caplog):
    _commit(store, 1)
    good = store.read(1).files["state.pt"]
    real_read, served = store._backend.read, []

    def read_truncated_once(path):
        data = real_read(path)
        if path.endswith("state.pt") and not served:
            served.append(path)
            return data[:-3]  # a connection that dropped the tail, once
        return data

    monkeypatch.setattr(store._backend, "read", read_truncated_once)
    with caplog.at_level(logging.WARNING, logger="storage.store"):
        assert store.latest().files["state.pt"] == good
    assert served and "verified on a second read" in caplog.text


def test_retention_keeps_last_k_and_cleans_partials(store):
    for step in (1, 2, 3):
        _commit(store, step)
    _overwrite(store, 0, "state.pt", b"dead writer leftovers")  # partial older than newest
    _overwrite(store, 9, "state.pt", b"in-flight write")  # partial newer: must survive
    deleted = store.apply_retention(keep_last=2, newest_good=3)
    assert deleted == [0, 1]
    assert store.committed_steps() == [2, 3]
    assert 9 in store.step_dirs()


def test_retention_never_deletes_newest_good(store):
    for step in (1, 2):
        _commit(store, step)
    # Even if the newest-by-number is not the one known good, the good one survives.
    assert store.apply_retention(keep_last=1, newest_good=1) == []
    assert store.committed_steps() == [1, 2]


def test_delete_uncommits(store):
    _commit(store, 1)
    _commit(store, 2)
    store.delete(2)
    assert store.committed_steps() == [1]
    assert store.latest().manifest.step == 1


def test_retention_keeps_milestones(store):
    for step in (10, 20, 30, 40, 50):
        _commit(store, step)
    assert store.retention_plan(keep_last=1, newest_good=50, keep_every=20) == [10, 30]
    assert store.apply_retention(keep_last=1, newest_good=50, keep_every=20) == [10, 30]
    assert store.committed_steps() == [20, 40, 50]


def test_failed_deletion_is_logged_not_raised(store, monkeypatch, caplog):
    for step in (1, 2, 3):
        _commit(store, step)

    def broken(step):
        raise PermissionError(f"cannot delete {step}")

    monkeypatch.setattr(store, "delete", broken)
    with caplog.at_level(logging.WARNING, logger="storage.store"):
        assert store.apply_retention(keep_last=1, newest_good=3) == []
    assert "could not delete step 1" in caplog.text and store.committed_steps() == [1, 2, 3]


def test_disk_full_leaves_earlier_checkpoints_intact(store, monkeypatch):
    import errno

    from storage import StorageFullError

    _commit(store, 1)
    real_create = store._backend.create

    def full(path, data):
        if "step-000000000002" in path:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_create(path, data)

    monkeypatch.setattr(store._backend, "create", full)
    with pytest.raises(StorageFullError, match=r"needs 100 bytes, the whole checkpoint 102 bytes"):
        _commit(store, 2, payload=b"y" * 100)
    assert store.committed_steps() == [1] and store.read(1).files["state.pt"] == b"payload-1" * 10
    assert 2 not in store.step_dirs()


def test_fencing_refuses_a_stale_writer(store):
    from storage import StaleWriterError

    assert store.read_fence() == 0
    store.commit(100, {"state-g1.pt": b"a"}, {}, generation=1)
    assert store.advance_fence(2) == 2  # a new attempt claims the store
    assert store.advance_fence(1) == 3  # a host with a slow clock still gets a newer generation
    store.commit(120, {"state-g3.pt": b"b"}, {}, generation=3)
    with pytest.raises(StaleWriterError, match="generation 1 is older than the store's 3"):
        store.commit(150, {"state-g1.pt": b"zombie"}, {}, generation=1)
    assert store.committed_steps() == [100, 120]


def test_a_late_stale_commit_never_outranks_the_current_generation(store):
    """A stale writer that passed its fence check just before a new attempt claimed the store
    can still land a manifest; ordering by (generation, step) keeps it from becoming "latest"."""
    import hashlib

    from storage.manifest import FileEntry, Manifest, step_dir_name

    store.commit(100, {"state-g1.pt": b"a"}, {}, generation=1)
    store.advance_fence(2)
    store.commit(120, {"state-g2.pt": b"b"}, {}, generation=2)
    backend, step_dir = store._backend, step_dir_name(150)
    backend.create(backend.join(backend.root, step_dir, "state-g1.pt"), b"zombie")
    entry = FileEntry(size=6, checksum=hashlib.sha256(b"zombie").hexdigest(), algorithm="sha256")
    late = Manifest(step=150, files={"state-g1.pt": entry}, generation=1)
    backend.create(backend.join(backend.root, step_dir, "manifest.json"), late.to_json())
    assert store.committed_steps() == [100, 120, 150]
    assert store.latest().manifest.step == 120


def test_run_files_live_beside_checkpoints_and_are_never_taken_for_one(store):
    """The history and the node check's marker, on every backend (S3 included): written whole,
    read back, listed in name order, and invisible to listing, latest and retention."""
    _commit(store, 10)
    store.write_marker("node-check-g7.json", b'{"generation": 7}')
    assert store.read_marker("node-check-g7.json") == b'{"generation": 7}'
    assert store.read_marker("node-check-g8.json") is None
    store.write_history("g7-s000001.jsonl", b'{"event": "end"}\n')
    store.write_history("g7-s000000.jsonl", b'{"event": "start"}\n')
    store.write_history("g7-s000000.jsonl", b'{"event": "start"}\n{"event": "resume"}\n')  # a retry
    assert store.read_history() == [
        ("g7-s000000.jsonl", b'{"event": "start"}\n{"event": "resume"}\n'),
        ("g7-s000001.jsonl", b'{"event": "end"}\n'),
    ]
    store.delete_marker("node-check-g7.json")
    assert store.read_marker("node-check-g7.json") is None
    assert store.committed_steps() == [10] and [c.step for c in store.list()] == [10]
    assert store.apply_retention(keep_last=1, newest_good=10) == []
    assert len(store.read_history()) == 2


def test_the_size_check_lists_the_step_once_and_names_a_missing_or_truncated_file(store):
    """Before anyone reads a sharded checkpoint, one listing of the step (not a request per file:
    that grew with the number of ranks) proves every file is there at its recorded size."""
    names = {f"shard-r{r:05d}.bin": bytes([r]) * (10 + r) for r in range(12)}
    manifest = store.commit(3, names, {"step": 3})
    backend, listings = store._backend, []  # the backend is what a request reaches
    real_list = backend.list_sizes

    def counted(path):
        listings.append(path)
        return real_list(path)

    def no_per_file_request(path):
        raise AssertionError(f"a metadata request per file: {path}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "list_sizes", counted)
        mp.setattr(backend, "size", no_per_file_request)
        mp.setattr(backend, "exists", no_per_file_request)
        store.check_sizes(manifest)
        assert len(listings) == 1
        _overwrite(store, 3, "shard-r00007.bin", b"short")
        with pytest.raises(CheckpointCorruptError, match="'shard-r00007.bin' is 5 bytes"):
            store.check_sizes(manifest)
        backend.delete_file(backend.join(backend.root, step_dir_name(3), "shard-r00011.bin"))
        with pytest.raises(CheckpointCorruptError, match="'shard-r00007.bin' is 5 bytes"):
            store.check_sizes(manifest)  # the first bad file in the manifest's order is named
        _overwrite(store, 3, "shard-r00007.bin", names["shard-r00007.bin"])
        with pytest.raises(CheckpointCorruptError, match="'shard-r00011.bin' is missing"):
            store.check_sizes(manifest)

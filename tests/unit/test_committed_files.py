"""tests/helpers/committed_files.py, the write-once checker the long fault jobs run: it must flag
a committed file rewritten in place or deleted under its manifest, and nothing that retention or
a newer generation's replacement does."""

from __future__ import annotations

import os

import storage
from tests.helpers.committed_files import CommittedFiles


def test_retention_and_a_newer_generations_replacement_are_no_violation(tmp_path):
    store = storage.open_store(str(tmp_path / "ckpt"))
    with CommittedFiles(tmp_path, interval_s=60) as files:  # looks only when told, and at exit
        for step in (1, 2, 3):
            store.commit(step, {"state-g1.bin": bytes([step]) * 100}, {}, generation=1)
        files.look()
        assert store.apply_retention(keep_last=2, newest_good=3) == [1]
        entry, _ = store.write_file(3, "state-g2.bin", b"newer" * 20)
        store.commit_written(3, {"state-g2.bin": entry}, {}, generation=2, replace_older=True)
        files.look()
    files.check()
    assert files.manifests_seen == 4  # steps 1, 2, 3, and 3 again


def test_a_committed_file_rewritten_in_place_or_deleted_under_its_manifest_is_flagged(tmp_path):
    store = storage.open_store(str(tmp_path / "ckpt"))
    for step in (1, 2):
        store.commit(step, {"state-g1.bin": bytes([step]) * 100}, {}, generation=1)
    rewritten = os.path.join(store.url, "step-000000000001", "state-g1.bin")
    deleted = os.path.join(store.url, "step-000000000002", "state-g1.bin")
    with CommittedFiles(tmp_path, interval_s=60) as files:
        files.look()
        with open(rewritten, "r+b") as f:  # in place, at the same size
            f.write(b"other bytes")
        os.unlink(deleted)
    assert len(files.violations) == 2, files.violations
    # Seen as a new mtime by a look, or (within the clock's tick) by the re-hash at the end.
    assert any(v.startswith(rewritten) and ("rewritten" in v or "changed" in v)
               for v in files.violations)  # fmt: skip
    assert f"{deleted}: deleted while its manifest still lists it" in files.violations

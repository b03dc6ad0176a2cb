"""storage.local: a filesystem without hard links (FAT, some FUSE mounts) still gets write-once
publishing, by an exclusive create of the name itself; and a failed write leaves no file under
its name, only a temporary one it removes."""

from __future__ import annotations

import errno
import os

import pytest

from storage.local import LocalBackend


def test_without_hard_links_a_name_is_still_created_once(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted (no hard links here)")

    monkeypatch.setattr(os, "link", no_links)
    backend = LocalBackend(str(tmp_path))
    path = str(tmp_path / "step-000000000001" / "state-g1.bin")
    assert backend.create(path, b"first") and not backend._links
    assert not backend.create(path, b"second")
    assert backend.read(path) == b"first"
    assert sorted(os.listdir(tmp_path / "step-000000000001")) == ["state-g1.bin"]


def test_a_write_that_fails_leaves_nothing_under_its_name(tmp_path, monkeypatch):
    backend = LocalBackend(str(tmp_path))
    path = str(tmp_path / "step-000000000001" / "state-g1.bin")
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        backend.create(path, b"x" * 1000)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert os.listdir(tmp_path / "step-000000000001") == []  # not even the temporary name
    assert backend.create(path, b"x" * 1000)  # the retry publishes it whole

"""Backend for any other fsspec filesystem (s3://, memory://, gcs://, ...).

Object stores have no rename; a single PUT of the small manifest is atomic, which is the commit.
A checkpoint's files are published with fsspec's ``pipe_file(mode="create")``: on S3 (s3fs) a
conditional PUT (``If-None-Match: *``, also on a multipart upload's completion) that the server
refuses when the key exists; on ``memory://`` an exclusive open (``"xb"``); on a filesystem that
implements neither, fsspec's default looks before it writes (``create_guarantee``;
docs/checkpoints.md, "Write-once").
"""

from __future__ import annotations

import contextlib

import fsspec

_WHOLE_COPY_LIMIT = 64 << 20


class _PartsView:
    """``len`` and slicing of a memoryview, each slice as bytes: what s3fs's multipart upload
    (``pipe_file``) needs from its data, without a copy of the whole."""

    def __init__(self, view: memoryview) -> None:
        self._view = view

    def __len__(self) -> int:
        return len(self._view)

    def __getitem__(self, index: slice) -> bytes:
        return bytes(self._view[index])


# Filesystems whose ``pipe_file(mode="create")`` the server itself refuses on an existing name,
# checked by tests/storage/test_conformance.py: s3fs sends ``If-None-Match: *`` (AWS S3 honours it
# since 2024, and moto; the startup probe checks the endpoint, ``probe.check_create``).
# memory:// opens with "xb", which looks and then creates within one call: "checked".
_ATOMIC_CREATE = {"s3", "s3a"}


def _create_guarantee(fs: fsspec.AbstractFileSystem) -> str:
    """What ``create`` promises on ``fs``: "atomic" where the filesystem refuses an existing name
    itself, else "checked" (fsspec's default ``pipe_file(mode="create")`` looks, then writes: a
    name is never knowingly written twice, but two writers racing for it both may)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "atomic" if _ATOMIC_CREATE & set(protocols) else "checked"


class FsspecBackend:
    def __init__(self, fs: fsspec.AbstractFileSystem, root: str) -> None:
        self.fs = fs
        self.root = root
        self.create_guarantee = _create_guarantee(fs)
        self.look_first = False
        """Set by the startup probe when the endpoint ignored a conditional create (an S3
        look-alike without ``If-None-Match``): every create then looks before it writes."""

    def join(self, *parts: str) -> str:
        return "/".join(p.rstrip("/") for p in parts)

    def create(self, path: str, data: bytes | memoryview) -> bool:
        """Publish ``data`` at ``path`` unless an object is there: True when this call created
        it, False when one existed (left untouched)."""
        if isinstance(data, memoryview) and len(data) >= _WHOLE_COPY_LIMIT:
            # Object stores' clients want bytes, but a whole copy of a multi-GB state would double
            # the memory: hand s3fs a sliceable view whose parts (uploaded concurrently) are copied
            # one at a time.
            data = _PartsView(data)
        elif isinstance(data, memoryview):
            data = bytes(data)
        if self.look_first and self.exists(path):
            return False
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        finally:
            self.fs.invalidate_cache(path)
        return True

    def write_atomic(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)

    def read(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """One ranged GET on object stores."""
        return self.fs.cat_file(path, start=start, end=end)

    def open_read(self, path: str):
        """Random-access reads: only the bytes actually read are fetched."""
        return self.fs.open(path, "rb")

    def size(self, path: str) -> int:
        self.fs.invalidate_cache(path)
        return int(self.fs.size(path))

    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return self.fs.exists(path)

    def list_names(self, path: str) -> list[str]:
        # Listings are cached by some backends (s3fs); a stale one would hide a new commit.
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def list_sizes(self, path: str) -> dict[str, int]:
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return {}
        return {
            e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e["size"])
            for e in entries
            if e.get("type") == "file"
        }

    def check_readable(self) -> None:
        # A missing prefix lists as empty, but so does a missing bucket through list_names: list the
        # bucket itself (the root's first component) so that one raises FileNotFoundError.
        self.fs.invalidate_cache(self.root)
        try:
            self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            self.fs.ls(self.root.split("/", 1)[0], detail=False)

    def delete_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def delete_tree(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)
        self.fs.invalidate_cache(path)

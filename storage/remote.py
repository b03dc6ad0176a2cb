"""Backend for any other fsspec filesystem (s3://, memory://, gcs://, ...).

Object stores have no rename; a single PUT of the small manifest is atomic, which is the commit.
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


class FsspecBackend:
    def __init__(self, fs: fsspec.AbstractFileSystem, root: str) -> None:
        self.fs = fs
        self.root = root

    def join(self, *parts: str) -> str:
        return "/".join(p.rstrip("/") for p in parts)

    def write(self, path: str, data: bytes | memoryview) -> None:
        if isinstance(data, memoryview) and len(data) >= _WHOLE_COPY_LIMIT:
            # Object stores' clients want bytes, but a whole copy of a multi-GB state would double
            # the memory: hand s3fs a sliceable view whose parts (uploaded concurrently) are copied
            # one at a time.
            data = _PartsView(data)
        elif isinstance(data, memoryview):
            data = bytes(data)
        self.fs.pipe_file(path, data)

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

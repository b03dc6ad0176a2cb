"""Local-disk backend: fsync'd writes and an atomic rename for the commit marker."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid


def _fsync_dir(path: str) -> None:
    # A rename is durable only once the directory entry itself is flushed.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalBackend:
    def __init__(self, root: str) -> None:
        self.root = root

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def write(self, path: str, data: bytes | memoryview) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def write_atomic(self, path: str, data: bytes) -> None:
        directory = os.path.dirname(path)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
        try:
            self.write(tmp, data)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        _fsync_dir(directory)

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def read_range(self, path: str, start: int, end: int) -> bytes:
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            return f.read(end - start)

    def open_read(self, path: str):
        return open(path, "rb", buffering=0)  # noqa: SIM115 - the caller closes it; no extra copy

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def list_names(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def list_sizes(self, path: str) -> dict[str, int]:
        try:
            with os.scandir(path) as entries:
                return {e.name: e.stat().st_size for e in entries if e.is_file()}
        except FileNotFoundError:
            return {}

    def check_readable(self) -> None:
        if os.path.exists(self.root) and not os.access(self.root, os.R_OK | os.X_OK):
            raise PermissionError(f"cannot list {self.root!r}")

    def delete_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def delete_tree(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(path)

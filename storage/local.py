"""Local-disk backend: files published once (a temporary name, fsync, then a hard link that fails
if the name exists), and an atomic rename for the few files that are replaced by design."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid

# A filesystem without hard links (FAT, some FUSE mounts, SMB without Unix extensions) answers a
# link with one of these; it then gets an exclusive create instead (``_create_exclusive``).
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV}


def _fsync_dir(path: str) -> None:
    # A new name is durable only once the directory entry itself is flushed.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(path: str) -> str:
    """A name beside ``path`` that nothing else uses, hidden (a leading dot): listings of
    checkpoint files and the history skip it."""
    directory, base = os.path.split(path)
    return os.path.join(directory, f".{base}.tmp-{uuid.uuid4().hex}")


def _write_new(path: str, data: bytes | memoryview) -> None:
    """Write a file that must not exist yet (``x``: never truncates one), durably."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class LocalBackend:
    # ``create`` is atomic: the name appears whole or not at all, and only if it was free.
    create_guarantee = "atomic"

    def __init__(self, root: str) -> None:
        self.root = root
        self._links = True
        """False once the filesystem refused a hard link: exclusive creates from then on."""

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def create(self, path: str, data: bytes | memoryview) -> bool:
        """Publish ``data`` at ``path`` unless a file is there: True when this call created it,
        False when one existed (left untouched). The bytes go to a temporary name first, are
        fsynced, then linked to ``path``: a link fails on an existing name, so a committed file is
        never opened for writing, and a kill, a retry or a full disk leaves at most a temporary
        file, never a short one under ``path``."""
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        if not self._links:
            return self._create_exclusive(path, data)
        tmp = _temp_name(path)
        try:
            _write_new(tmp, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno not in _NO_HARD_LINKS:
                    raise
                self._links = False
                return self._create_exclusive(path, data)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        _fsync_dir(directory)
        return True

    def _create_exclusive(self, path: str, data: bytes | memoryview) -> bool:
        """Without hard links: ``O_EXCL`` on the name itself. Still never opens an existing file
        for writing; but a kill mid-write leaves a short file under ``path`` (uncommitted: no
        manifest lists it before its writer reported it whole)."""
        try:
            _write_new(path, data)
        except FileExistsError:
            return False
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # ours: the exclusive create made it
            raise
        _fsync_dir(os.path.dirname(path))
        return True

    def write_atomic(self, path: str, data: bytes) -> None:
        """Replace ``path`` whole (a temporary name, fsync, rename): for the files replaced by
        design (the fence, the history's segments, an older generation's manifest)."""
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = _temp_name(path)
        try:
            _write_new(tmp, data)
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

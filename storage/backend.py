"""The tiny protocol a storage backend implements, and the router from URL to backend."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, BinaryIO, Protocol

from storage.urls import is_local, open_url


class Backend(Protocol):
    """Byte-level operations on absolute paths of one filesystem.

    ``create`` publishes a new file and never opens an existing one for writing: it returns False
    when the name is taken, and leaves only temporary names behind when it fails; it is durable
    when it returns True. ``create_guarantee`` says how: "atomic" (the filesystem refuses a taken
    name itself, and the file appears whole or not at all) or "checked" (the backend looks, then
    writes). ``write_atomic`` replaces a file whole, for the few replaced by design (the fence, the
    history, an older generation's manifest). ``check_readable`` raises when the root can never
    be listed (a missing bucket, rejected credentials, an unreachable endpoint); a root that simply
    holds nothing yet is fine.
    """

    root: str
    create_guarantee: str

    def create(self, path: str, data: bytes | memoryview) -> bool: ...
    def write_atomic(self, path: str, data: bytes) -> None: ...
    def read(self, path: str) -> bytes: ...
    def open_read(self, path: str) -> BinaryIO: ...
    def read_range(self, path: str, start: int, end: int) -> bytes: ...
    def size(self, path: str) -> int: ...
    def exists(self, path: str) -> bool: ...
    def list_names(self, path: str) -> list[str]: ...
    def list_sizes(self, path: str) -> dict[str, int]:
        """Every file directly under ``path`` with its size, from one listing (paged by the
        server): no per-file metadata request."""
        ...

    def check_readable(self) -> None: ...
    def delete_file(self, path: str) -> None: ...
    def delete_tree(self, path: str) -> None: ...
    def join(self, *parts: str) -> str: ...


def open_backend(url: str, options: Mapping[str, Any] | None = None) -> Backend:
    """Route ``url`` to the backend that handles it."""
    fs, root = open_url(url, options)
    if is_local(url):
        from storage.local import LocalBackend

        return LocalBackend(root)
    from storage.remote import FsspecBackend

    return FsspecBackend(fs, root)

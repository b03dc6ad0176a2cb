"""SHA-256 of checkpoint payloads, overlapped with the I/O that moves them.

Writing: a big payload is hashed on a helper thread while the backend writes it. Reading: a big file
is read in chunks into one writable buffer, each chunk hashed on the helper thread while the next is
read, so verifying costs max(read, hash), not their sum. Both hashing and file I/O release the GIL.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import mmap

from storage.backend import Backend

PIPELINE_BYTES = 8 << 20  # payloads from this size on are hashed while being written or read
_READ_CHUNK = 4 << 20  # small: the last chunk's hash is the only one not overlapped


@functools.cache
def _hasher() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="storage-hash")


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def hash_in_background(data: bytes | memoryview) -> concurrent.futures.Future[str] | None:
    """Start hashing a big payload (the caller writes it meanwhile); None for a small one."""
    return _hasher().submit(sha256_hex, data) if len(data) >= PIPELINE_BYTES else None


def read_hashed(backend: Backend, path: str, size: int) -> tuple[bytes | memoryview, str]:
    """A file's bytes and sha256, given the size its manifest records.

    A big file lands in one writable buffer (loaded tensors are views into it). The buffer is an
    anonymous mapping: its pages are not zeroed up front (a ``bytearray`` would be, costing half a
    read again). A file shorter or longer than ``size`` comes back with that length and no digest.
    """
    if size < PIPELINE_BYTES:
        data = backend.read(path)
        return data, sha256_hex(data)
    view = memoryview(mmap.mmap(-1, size))
    hasher, offset, pending = hashlib.sha256(), 0, None
    with backend.open_read(path) as f:
        while offset < size:
            n = f.readinto(view[offset : offset + _READ_CHUNK])
            if not n:
                break
            if pending is not None:
                pending.result()
            pending = _hasher().submit(hasher.update, view[offset : offset + n])
            offset += n
        longer = bool(f.read(1))
    if pending is not None:
        pending.result()
    if offset < size:
        return view[:offset], ""
    if longer:
        return bytes(size + 1), ""  # only its length is looked at: longer than recorded
    return view, hasher.hexdigest()

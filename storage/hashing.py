"""SHA-256 of checkpoint payloads, overlapped with the I/O that moves them.

A file is hashed whole (``block_size`` 0), or block by block: its recorded hash is then the SHA-256
of its blocks' digests (a hash list), and the digests themselves let a reader verify any byte range
it reads without reading the rest: what a resharding resume needs, where each rank reads only the
slices of other ranks' shards that it owns now.

Writing: a big payload is hashed on a helper thread while the backend writes it. Reading: a big file
is read in chunks into one writable buffer, each chunk hashed on the helper thread while the next is
read, so verifying costs max(read, hash), not their sum. Both hashing and file I/O release the GIL.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import mmap
from dataclasses import dataclass

from storage.backend import Backend

PIPELINE_BYTES = 8 << 20  # payloads from this size on are hashed while being written or read
_READ_CHUNK = 4 << 20  # small: the last chunk's hash is the only one not overlapped


@functools.cache
def _hasher() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="storage-hash")


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Digest:
    root: str
    """What the manifest records: the file's SHA-256, or the SHA-256 of its block digests."""
    blocks: tuple[str, ...] = ()
    """With a block size: each block's SHA-256, in order (what a ranged read verifies against)."""


def block_root(blocks: tuple[str, ...] | list[str]) -> str:
    return hashlib.sha256(b"".join(bytes.fromhex(b) for b in blocks)).hexdigest()


def digest(data: bytes | memoryview, block_size: int = 0) -> Digest:
    if not block_size:
        return Digest(sha256_hex(data))
    view = memoryview(data).cast("B")
    blocks = tuple(
        sha256_hex(view[i : i + block_size]) for i in range(0, max(len(view), 1), block_size)
    )
    return Digest(block_root(blocks), blocks)


def hash_in_background(
    data: bytes | memoryview, block_size: int = 0
) -> concurrent.futures.Future[Digest] | None:
    """Start hashing a big payload (the caller writes it meanwhile); None for a small one."""
    if len(data) < PIPELINE_BYTES:
        return None
    return _hasher().submit(digest, data, block_size)


class _Hasher:
    """Incremental whole-file or block-list hashing of data that arrives in block-aligned pieces."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.whole = hashlib.sha256()
        self.blocks: list[str] = []

    def update(self, piece: memoryview) -> None:
        if not self.block_size:
            self.whole.update(piece)
            return
        for i in range(0, len(piece), self.block_size):
            self.blocks.append(sha256_hex(piece[i : i + self.block_size]))

    def root(self) -> str:
        return (
            block_root(self.blocks or [sha256_hex(b"")])
            if self.block_size
            else self.whole.hexdigest()
        )


def read_hashed(
    backend: Backend, path: str, size: int, block_size: int = 0
) -> tuple[bytes | memoryview, str]:
    """A file's bytes and sha256, given the size its manifest records.

    A big file lands in one writable buffer (loaded tensors are views into it). The buffer is an
    anonymous mapping: its pages are not zeroed up front (a ``bytearray`` would be, costing half a
    read again). A file shorter or longer than ``size`` comes back with that length and no digest.
    """
    if size < PIPELINE_BYTES:
        data = backend.read(path)
        return data, digest(data, block_size).root
    view = memoryview(mmap.mmap(-1, size))
    hasher, offset, pending = _Hasher(block_size), 0, None
    # Whole blocks per piece, so each block is hashed in one go.
    chunk = max(block_size, _READ_CHUNK - _READ_CHUNK % block_size) if block_size else _READ_CHUNK
    with backend.open_read(path) as f:
        while offset < size:
            n = _fill(f, view[offset : offset + chunk])
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
    return view, hasher.root()


def _fill(f, view: memoryview) -> int:
    """Read until ``view`` is full or the file ends (a stream may return short reads)."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got

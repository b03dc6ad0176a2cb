"""Checksums of checkpoint payloads, overlapped with the I/O that moves them.

Two algorithms, named in every manifest entry (so old checkpoints keep verifying):

- ``xxh3`` (XXH3-128, the default): 10-15 GB/s on one core, so verifying keeps up with a RAM disk.
  The threat is corruption (torn writes, bit rot, a truncated upload), not forgery: whoever could
  forge a payload could rewrite its manifest too.
- ``sha256``: 1.4 GB/s; what every checkpoint before the choice existed was written with.

A file is hashed whole (``block_size`` 0), or block by block: its recorded hash is then the hash
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
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from storage.backend import Backend

ALGORITHMS: dict[str, Callable[[], object]] = {"xxh3": xxhash.xxh3_128, "sha256": hashlib.sha256}
DEFAULT_ALGORITHM = "xxh3"


def check_algorithm(name: str, setting: str = "checksum") -> str:
    if name not in ALGORITHMS:
        raise ValueError(f"{setting} must be one of {sorted(ALGORITHMS)}, got {name!r}.")
    return name


PIPELINE_BYTES = 8 << 20  # payloads from this size on are hashed while being written or read
_READ_CHUNK = 4 << 20  # small: the last chunk's hash is the only one not overlapped


@functools.cache
def _hasher() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="storage-hash")


def stop_hasher() -> None:
    """End the helper thread (after any hash in flight); the next big payload starts a new one.
    For a process about to exit: no thread of ours is left for interpreter teardown."""
    if _hasher.cache_info().currsize:
        _hasher().shutdown(wait=True)
        _hasher.cache_clear()


def hex_digest(data: bytes | memoryview, algorithm: str) -> str:
    h = ALGORITHMS[algorithm]()
    h.update(data)
    return h.hexdigest()


@dataclass(frozen=True)
class Digest:
    root: str
    """What the manifest records: the file's hash, or the hash of its block digests."""
    blocks: tuple[str, ...] = ()
    """With a block size: each block's hash, in order (what a ranged read verifies against)."""
    algorithm: str = DEFAULT_ALGORITHM


def block_root(blocks: tuple[str, ...] | list[str], algorithm: str) -> str:
    return hex_digest(b"".join(bytes.fromhex(b) for b in blocks), algorithm)


def digest(
    data: bytes | memoryview, block_size: int = 0, algorithm: str = DEFAULT_ALGORITHM
) -> Digest:
    if not block_size:
        return Digest(hex_digest(data, algorithm), algorithm=algorithm)
    view = memoryview(data).cast("B")
    blocks = tuple(
        hex_digest(view[i : i + block_size], algorithm)
        for i in range(0, max(len(view), 1), block_size)
    )
    return Digest(block_root(blocks, algorithm), blocks, algorithm)


def hash_in_background(
    data: bytes | memoryview, block_size: int = 0, algorithm: str = DEFAULT_ALGORITHM
) -> concurrent.futures.Future[Digest] | None:
    """Start hashing a big payload (the caller writes it meanwhile); None for a small one."""
    if len(data) < PIPELINE_BYTES:
        return None
    return _hasher().submit(digest, data, block_size, algorithm)


class _Hasher:
    """Incremental whole-file or block-list hashing of data that arrives in block-aligned pieces."""

    def __init__(self, block_size: int, algorithm: str) -> None:
        self.block_size = block_size
        self.algorithm = algorithm
        self.whole = ALGORITHMS[algorithm]()
        self.blocks: list[str] = []

    def update(self, piece: memoryview) -> None:
        if not self.block_size:
            self.whole.update(piece)
            return
        for i in range(0, len(piece), self.block_size):
            self.blocks.append(hex_digest(piece[i : i + self.block_size], self.algorithm))

    def root(self) -> str:
        if not self.block_size:
            return self.whole.hexdigest()
        return block_root(self.blocks or [hex_digest(b"", self.algorithm)], self.algorithm)


def read_hashed(
    backend: Backend, path: str, size: int, block_size: int = 0, algorithm: str = DEFAULT_ALGORITHM
) -> tuple[bytes | memoryview, str]:
    """A file's bytes and hash (``algorithm``), given the size its manifest records.

    A big file lands in one writable buffer (loaded tensors are views into it). The buffer is an
    anonymous mapping: its pages are not zeroed up front (a ``bytearray`` would be, costing half a
    read again). A file shorter or longer than ``size`` comes back with that length and no digest.
    """
    if size < PIPELINE_BYTES:
        data = backend.read(path)
        return data, digest(data, block_size, algorithm).root
    view = memoryview(mmap.mmap(-1, size))
    hasher, offset, pending = _Hasher(block_size, algorithm), 0, None
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


def hash_stream(
    backend: Backend, path: str, block_size: int = 0, algorithm: str = DEFAULT_ALGORITHM
) -> tuple[int, str]:
    """(size, hash) of a file read once through one reused buffer: verifies a file of any size
    in constant memory, for a reader that then takes only the pieces it needs (``export``)."""
    hasher, size = _Hasher(block_size, algorithm), 0
    chunk = max(block_size, _READ_CHUNK - _READ_CHUNK % block_size) if block_size else _READ_CHUNK
    buffer = memoryview(bytearray(chunk))
    with backend.open_read(path) as f:
        while n := _fill(f, buffer):
            hasher.update(buffer[:n])
            size += n
    return size, hasher.root()


def _fill(f, view: memoryview) -> int:
    """Read until ``view`` is full or the file ends (a stream may return short reads)."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got

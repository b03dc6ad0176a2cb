"""I/O helpers the benches share."""

from __future__ import annotations

import os


def drop_cache(path: str) -> None:
    """Evict a local file's pages so the next read comes from the device, not memory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)

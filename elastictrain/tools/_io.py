"""I/O and process helpers the benches share."""

from __future__ import annotations

import os


def drop_cache(path: str) -> None:
    """Evict a local file's pages so the next read comes from the device, not memory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def child_env() -> dict[str, str]:
    """The environment for a bench's child job: one thread per process, as under torchrun, and
    this checkout importable (``-m elastictrain`` runs the code being measured)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }

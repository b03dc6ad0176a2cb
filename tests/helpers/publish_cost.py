"""Manual (docs/measurements.md, "Write-once's cost"): what publishing a file once costs beside a
plain write, side by side, alternating which goes first, on the folders given.

    python -m tests.helpers.publish_cost /tmp/scratch /dev/shm/scratch

The plain write is what ``LocalBackend.write`` did before write-once: ``open(name, "wb")``, write,
fsync. Publishing (``LocalBackend.create``) writes a temporary name, fsyncs it, links it to the
name, removes the temporary name and fsyncs the folder. Prints the median of 60 pairs per size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

from storage.local import LocalBackend


def plain_write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def measure(folder: str, size: int, pairs: int = 60) -> tuple[float, float]:
    """(median plain write, median publish) in seconds for files of ``size`` bytes."""
    os.makedirs(folder, exist_ok=True)
    backend, data = LocalBackend(folder), os.urandom(size)
    plain, publish = [], []
    for i in range(pairs):
        ways = [
            (lambda p: plain_write(p, data), plain),
            (lambda p: backend.create(p, data), publish),
        ]
        for write, times in ways if i % 2 else ways[::-1]:
            path = os.path.join(folder, f"f-{uuid.uuid4().hex}")
            t0 = time.perf_counter()
            write(path)
            times.append(time.perf_counter() - t0)
            os.unlink(path)
    return statistics.median(plain), statistics.median(publish)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", help="scratch folders (created; files are removed)")
    for folder in p.parse_args().folders:
        for size in (4 << 10, 4 << 20):
            plain, publish = measure(folder, size)
            print(
                f"{folder} {size >> 10} KiB: plain write {plain * 1e3:.3f} ms, publish "
                f"{publish * 1e3:.3f} ms (+{(publish - plain) * 1e3:.3f} ms, {publish / plain:.2f}x)"
            )


if __name__ == "__main__":
    main()

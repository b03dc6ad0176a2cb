"""A slow remote for ``bench --recovery --remote-mbps``: ``throttled://PATH``, a local folder
reached at a fixed bandwidth, through the same fsspec code path as S3 (not the local backend).

Workers import this module through ``--task elastictrain.tools.throttled_fs:make_task``, which
registers the protocol and returns the toy task. ``ET_THROTTLE_BPS`` sets the bytes per second
of each process's link (reads and writes share it); every state-file byte read is appended as
``pid<TAB>bytes<TAB>path`` to ``ET_THROTTLE_LOG``, so the bench counts what a resume read.
"""

from __future__ import annotations

import os
import threading
import time

import fsspec
from fsspec.implementations.local import LocalFileSystem

from elastictrain.toy import make_task as make_toy_task

_lock = threading.Lock()
_link_free_at = 0.0


def _throttle(nbytes: int) -> None:
    global _link_free_at
    bps = float(os.environ.get("ET_THROTTLE_BPS", "0"))
    if not bps or not nbytes:
        return
    with _lock:
        start = max(time.monotonic(), _link_free_at)
        _link_free_at = done = start + nbytes / bps
    time.sleep(max(0.0, done - time.monotonic()))


def _record(nbytes: int, path: str) -> None:
    log = os.environ.get("ET_THROTTLE_LOG")
    if log and nbytes:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\t{nbytes}\t{path}\n")


class ThrottledFileSystem(LocalFileSystem):
    protocol = ("throttled",)

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("auto_mkdir", True)  # object-store semantics: no directories to make
        super().__init__(*args, **kwargs)

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str) and path.startswith("throttled://"):
            path = path[len("throttled://") :]
        return super()._strip_protocol(path)

    def cat_file(self, path, start=None, end=None, **kwargs):
        data = super().cat_file(path, start=start, end=end, **kwargs)
        _throttle(len(data))
        _record(len(data), str(path))
        return data

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        _throttle(len(value))
        return super().pipe_file(path, value, **kwargs)

    def _open(self, path, mode="rb", **kwargs):
        f = super()._open(path, mode=mode, **kwargs)
        return _Reader(f, str(path)) if "r" in mode else f


class _Reader:
    def __init__(self, f, path: str) -> None:
        self._f, self._path = f, path

    def read(self, *args):
        data = self._f.read(*args)
        _throttle(len(data))
        _record(len(data), self._path)
        return data

    def readinto(self, buffer):
        n = self._f.readinto(buffer) or 0
        _throttle(n)
        _record(n, self._path)
        return n

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


fsspec.register_implementation("throttled", ThrottledFileSystem, clobber=True)


def make_task(options):
    return make_toy_task(options)


def bytes_read(log: str, fragment: str = "/state-") -> int:
    if not os.path.exists(log):
        return 0
    with open(log) as f:
        return sum(int(line.split("\t")[1]) for line in f if fragment in line.split("\t")[2])

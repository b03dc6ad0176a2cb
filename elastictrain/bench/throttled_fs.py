"""A slow remote for the benches: ``throttled://PATH``, a local folder reached at a fixed bandwidth
and, for ``bench scale``, a fixed latency per request, through the same fsspec code path as S3 (not
the local backend). It counts requests as S3 would bill them: a listing is one request per 1,000
names (S3's page), and the metadata a listing returns costs nothing more.

Workers import this module through ``--task elastictrain.bench.throttled_fs:make_task``, which
registers the protocol and returns the toy task. ``ET_THROTTLE_BPS`` sets the bytes per second
of each process's link (reads and writes share it); every state-file byte read is appended as
``pid<TAB>bytes<TAB>path`` to ``ET_THROTTLE_LOG``, so the bench counts what a resume read.
``ET_THROTTLE_LATENCY_MS`` adds that many milliseconds to every request (a sleep, so requests made
in parallel overlap as they would against S3); ``ET_THROTTLE_STALL_FROM``/``_UNTIL`` (epoch seconds)
hold every request made between them until the second; ``REQUESTS`` and ``BYTES`` count them
in-process.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time

import fsspec
from fsspec.implementations.local import LocalFileSystem

from elastictrain.toy import make_task as make_toy_task

_lock = threading.Lock()
_link_free_at = 0.0
_inside = threading.local()  # a request made inside another (ls calls info) is not a second one
REQUESTS: collections.Counter = collections.Counter()  # kind (put, get, head, list, delete) -> n
BYTES: collections.Counter = collections.Counter()  # "read", "written" -> bytes, this process


def _request(kind: str, pages: int = 1) -> bool:
    """Count (and delay) one request unless this thread is already inside one."""
    if getattr(_inside, "depth", 0):
        return False
    with _lock:
        REQUESTS[kind] += pages
    latency_ms = float(os.environ.get("ET_THROTTLE_LATENCY_MS", "0") or 0)
    if latency_ms:
        time.sleep(pages * latency_ms / 1e3)
    # A stall: every request made inside [FROM, UNTIL) (epoch seconds) waits until UNTIL.
    stall = [
        float(os.environ.get(f"ET_THROTTLE_STALL_{end}", "0") or 0) for end in ("FROM", "UNTIL")
    ]
    if stall[0] <= time.time() < stall[1]:
        time.sleep(stall[1] - time.time())
    return True


class _Request:
    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __enter__(self):
        _request(self.kind)
        _inside.depth = getattr(_inside, "depth", 0) + 1

    def __exit__(self, *exc):
        _inside.depth -= 1


def _throttle(nbytes: int, bps: float) -> None:
    """Hold ``nbytes`` back until this process's link has carried them (threads queue)."""
    global _link_free_at
    if not bps or not nbytes:
        return
    with _lock:
        start = max(time.monotonic(), _link_free_at)
        _link_free_at = done = start + nbytes / bps
    time.sleep(max(0.0, done - time.monotonic()))


class ThrottledFileSystem(LocalFileSystem):
    """``log_env``/``bps_env``: the environment variables a subclass reads instead (the test
    suite's ``counting://`` only counts)."""

    protocol = ("throttled",)
    log_env, bps_env = "ET_THROTTLE_LOG", "ET_THROTTLE_BPS"

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("auto_mkdir", True)  # object-store semantics: no directories to make
        super().__init__(*args, **kwargs)

    @classmethod
    def _strip_protocol(cls, path):
        prefix = f"{cls.protocol[0]}://"
        if isinstance(path, str) and path.startswith(prefix):
            path = path[len(prefix) :]
        return super()._strip_protocol(path)

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        # ``value`` may be bytes or the backend's sliceable view of a big payload (what s3fs
        # uploads in parts): written here 8 MB at a time, each part through the link.
        # ``mode="create"``: fsspec's own rule (look, then write), as most filesystems have it.
        # A put appears whole or not at all, as an object store's does: the parts go to a hidden
        # name beside it, renamed into place at the end (written in place, a reader could see a
        # committed manifest empty: a fresh-clone CI run of 2026-12-07 did).
        part = 8 << 20
        path = self._strip_protocol(path)
        if mode == "create" and super().exists(path):
            _request("put")
            raise FileExistsError(path)
        folder, name = os.path.split(path)
        os.makedirs(folder, exist_ok=True)
        partial = os.path.join(folder, f".{name}.put-{os.getpid()}-{threading.get_ident()}")
        try:
            with _Request("put"), open(partial, "wb") as f:
                BYTES["written"] += len(value)
                for start in range(0, len(value), part):
                    chunk = value[start : start + part]
                    self._pass(len(chunk))
                    f.write(chunk)
            os.replace(partial, path)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)

    def _open(self, path, mode="rb", **kwargs):
        # Every read goes through here: whole-file reads (``cat_file`` opens and reads) and
        # chunked ones (``readinto``), so each byte is counted and throttled once.
        if "r" in mode:
            _request("get")
        f = super()._open(path, mode=mode, **kwargs)
        return _Reader(f, str(path), self) if "r" in mode else f

    def info(self, path, **kwargs):
        with _Request("head"):
            return super().info(path, **kwargs)

    def ls(self, path, detail=False, **kwargs):
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            entries = super().ls(path, detail=detail, **kwargs)
        finally:
            _inside.depth -= 1
        _request("list", pages=max(1, math.ceil(len(entries) / 1000)))
        return entries

    def rm_file(self, path):
        with _Request("delete"):
            return super().rm_file(path)

    def rm(self, path, recursive=False, maxdepth=None):
        with _Request("delete"):
            return super().rm(path, recursive=recursive, maxdepth=maxdepth)

    def _pass(self, nbytes: int) -> None:
        bps = float(os.environ.get(self.bps_env, "0")) if self.bps_env else 0.0
        _throttle(nbytes, bps)

    def _record(self, nbytes: int, path: str) -> None:
        log = os.environ.get(self.log_env)
        if log and nbytes:
            with open(log, "a") as f:
                f.write(f"{os.getpid()}\t{nbytes}\t{path}\n")


class _Reader:
    """A read-only file object whose every byte read passes the link and is recorded."""

    def __init__(self, f, path: str, fs: ThrottledFileSystem) -> None:
        self._f, self._path, self._fs = f, path, fs

    def _got(self, n: int) -> None:
        BYTES["read"] += n
        self._fs._pass(n)
        self._fs._record(n, self._path)

    def read(self, *args):
        data = self._f.read(*args)
        self._got(len(data))
        return data

    def readinto(self, buffer):
        n = self._f.readinto(buffer) or 0
        self._got(n)
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


def bytes_read(log: str, fragments: tuple[str, ...] = ("/state-",)) -> int:
    """Bytes read from files whose path holds one of ``fragments``."""
    if not os.path.exists(log):
        return 0
    with open(log) as f:
        rows = [line.split("\t") for line in f]
    return sum(int(row[1]) for row in rows if any(frag in row[2] for frag in fragments))

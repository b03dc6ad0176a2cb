"""A byte-counting fsspec filesystem (``counting://``) for measuring storage reads in real workers.

Workers import this module through ``--task tests.helpers.counting_fs:make_task``, which
registers the protocol and returns the toy task. Every read appends ``pid<TAB>bytes<TAB>path`` to
the file named by ``COUNTING_FS_LOG``. Every read goes through ``_open``: whole-file reads
(``cat_file`` opens and reads; small payloads) and chunked ones (``readinto``: payloads of 8 MB
and more), so counting there counts each byte once.
"""

from __future__ import annotations

import os

import fsspec
from fsspec.implementations.local import LocalFileSystem

from elastictrain.toy import make_task as make_toy_task


class CountingFileSystem(LocalFileSystem):
    protocol = ("counting",)

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str) and path.startswith("counting://"):
            path = path[len("counting://") :]
        return super()._strip_protocol(path)

    def _open(self, path, mode="rb", **kwargs):
        f = super()._open(path, mode=mode, **kwargs)
        return _CountingReader(f, path) if "r" in mode else f


def _record(nbytes: int, path: str) -> None:
    log = os.environ.get("COUNTING_FS_LOG")
    if log and nbytes:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\t{nbytes}\t{path}\n")


class _CountingReader:
    """A read-only file object that records every byte read through it."""

    def __init__(self, f, path: str) -> None:
        self._f, self._path = f, path

    def read(self, *args):
        data = self._f.read(*args)
        _record(len(data), self._path)
        return data

    def readinto(self, buffer):
        n = self._f.readinto(buffer)
        _record(n or 0, self._path)
        return n

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


fsspec.register_implementation("counting", CountingFileSystem, clobber=True)


def make_task(options):
    return make_toy_task(options)


def bytes_read(log: str, fragment: str) -> int:
    """Bytes read from files whose path contains ``fragment``."""
    if not os.path.exists(log):
        return 0
    with open(log) as f:
        return sum(int(line.split("\t")[1]) for line in f if fragment in line.split("\t")[2])

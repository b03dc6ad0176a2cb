"""A byte-counting fsspec filesystem (``counting://``) for measuring storage reads in real workers.

Workers import this module through ``--task tests.helpers.counting_fs:make_task``, which
registers the protocol and returns the toy task. Each read appends ``pid<TAB>bytes<TAB>path`` to the
file named by ``COUNTING_FS_LOG``.
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

    def cat_file(self, path, start=None, end=None, **kwargs):
        data = super().cat_file(path, start=start, end=end, **kwargs)
        log = os.environ.get("COUNTING_FS_LOG")
        if log:
            with open(log, "a") as f:
                f.write(f"{os.getpid()}\t{len(data)}\t{path}\n")
        return data


fsspec.register_implementation("counting", CountingFileSystem, clobber=True)


def make_task(options):
    return make_toy_task(options)


def bytes_read(log: str, fragment: str) -> int:
    """Bytes read from files whose path contains ``fragment``."""
    if not os.path.exists(log):
        return 0
    with open(log) as f:
        return sum(int(line.split("\t")[1]) for line in f if fragment in line.split("\t")[2])

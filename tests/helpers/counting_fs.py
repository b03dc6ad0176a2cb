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

from elastictrain.bench.throttled_fs import ThrottledFileSystem
from elastictrain.toy import make_task as make_toy_task


class CountingFileSystem(ThrottledFileSystem):
    """``throttled://`` without the throttle: every read recorded to ``COUNTING_FS_LOG``."""

    protocol = ("counting",)
    log_env, bps_env = "COUNTING_FS_LOG", None


fsspec.register_implementation("counting", CountingFileSystem, clobber=True)


def make_task(options):
    return make_toy_task(options)


def bytes_read(log: str, fragment: str) -> int:
    """Bytes read from files whose path contains ``fragment``."""
    if not os.path.exists(log):
        return 0
    with open(log) as f:
        return sum(int(line.split("\t")[1]) for line in f if fragment in line.split("\t")[2])

"""elastictrain.checkpoint.layouts: rank 0's commit gate for sharded checkpoints commits only with
every rank's report, and a rank that gave up (or never reports) leaves the step uncommitted
instead of hanging."""

from __future__ import annotations

import json
import threading
import time

import pytest

import storage
from elastictrain.checkpoint import sharded
from elastictrain.checkpoint.layouts import ShardedLayout, ShardsMissingError


def _report(store, rank: int, generation: int = 7) -> None:
    store.write_note(3, sharded.part_file(rank, generation), json.dumps({"rank": rank}).encode())


def test_waits_until_every_rank_reported(tmp_path):
    store = storage.open_store(str(tmp_path / "c"))
    layout = ShardedLayout(0, 3)
    _report(store, 0)
    _report(store, 2)
    _report(store, 1, generation=6)  # an older generation's report does not count
    late = threading.Timer(0.3, lambda: _report(store, 1))
    late.start()
    t0 = time.monotonic()
    parts = layout.wait_for_reports(store, 3, 7, lambda s: False, deadline_s=10)
    assert time.monotonic() - t0 >= 0.25
    assert [p["rank"] for p, _ in parts] == [0, 1, 2]


def test_a_rank_that_gave_up_ends_the_wait_without_a_commit(tmp_path):
    store = storage.open_store(str(tmp_path / "c"))
    _report(store, 0)
    with pytest.raises(ShardsMissingError, match=r"rank\(s\) \[1\].*gave up"):
        ShardedLayout(0, 2).wait_for_reports(store, 3, 7, lambda s: s == 3, deadline_s=60)
    with pytest.raises(ShardsMissingError, match="did not report in 0s"):
        ShardedLayout(0, 2).wait_for_reports(store, 3, 7, lambda s: False, deadline_s=0.05)
    assert not store.is_committed(3)
    # Skippable under --on-storage-failure warn, like any storage outage.
    assert isinstance(ShardsMissingError("x"), storage.StorageUnavailableError)

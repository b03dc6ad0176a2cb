"""Rank 0's commit gate for sharded checkpoints: it commits only with every rank's report, and a
rank that gave up (or never reports) leaves the step uncommitted instead of hanging."""

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


def test_no_new_checkpoint_is_written_after_one_failed_for_good(tmp_path):
    """``fail``: once a background persist failed, the next save starts nothing (the loop stops
    the run on the failure) instead of writing into storage that just refused a checkpoint."""
    import torch

    from elastictrain.checkpoint.layouts import FlatLayout
    from elastictrain.checkpoint.persist import (
        Persister,
        SaveOutcome,
        SaveRecord,
        StopTheRun,
    )
    from elastictrain.config import CheckpointConfig
    from elastictrain.observe.events import EventLog

    class DownStore:
        writes = 0

        def __getattr__(self, name):
            def down(*a, **k):
                DownStore.writes += 1
                raise storage.StorageUnavailableError(f"injected: {name} while storage is down")

            return down

    events = EventLog(None, enabled=False)
    config = CheckpointConfig(on_storage_failure="fail")
    record = SaveRecord()
    writer = Persister(
        store=DownStore(),
        layout=FlatLayout(),
        record=record,
        policy=StopTheRun(config, events),
        config=config,
        world_size=1,
        generation=lambda: 1,
        events=events,
        attached=lambda: True,
    )
    state = {"w": torch.ones(4)}
    writer.save(40, 0, "steps", lambda: state, background=True)
    writer.wait()
    assert record.failure is not None and record.failure.step == 40
    calls = DownStore.writes
    assert writer.save(60, 0, "steps", lambda: state, background=True)[0] is SaveOutcome.FAILED
    writer.wait()
    assert DownStore.writes == calls and record.failure.step == 40

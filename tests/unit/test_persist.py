"""elastictrain.checkpoint.write.persist: one writer, its record, and what a failure does (the policy),
on memory:// without any process group."""

from __future__ import annotations

import logging

import pytest
import torch

import storage
from elastictrain.checkpoint.api import Reason, SaveOutcome
from elastictrain.checkpoint.policies import StopTheRun, TurnTierOff
from elastictrain.checkpoint.record import SaveRecord
from elastictrain.checkpoint.write.layouts import FlatLayout
from elastictrain.checkpoint.write.persist import Persister
from elastictrain.config import CheckpointConfig
from elastictrain.errors import OrphanedError
from elastictrain.observe.events import Event, EventLog, read_events
from tests.helpers.one_process import memory_url


class Outage:
    """A real store whose commits fail while ``down`` (every other call goes through)."""

    def __init__(self, store: storage.CheckpointStore) -> None:
        self.store, self.down = store, False

    def commit(self, *a, **k):
        if self.down:
            raise storage.StorageUnavailableError("injected: the bucket is unreachable")
        return self.store.commit(*a, **k)

    def __getattr__(self, name):
        return getattr(self.store, name)


def writer(tmp_path, policy=None, attached=lambda: True, **settings):
    config = CheckpointConfig(checkpoint_dir=memory_url(), **settings)
    events = EventLog(str(tmp_path / "events.jsonl"), enabled=True)
    record = SaveRecord()
    store = Outage(storage.open_store(config.checkpoint_dir))
    persister = Persister(
        store=store,
        layout=FlatLayout(),
        config=config,
        record=record,
        policy=policy or StopTheRun(config, events),
        world_size=1,
        generation=lambda: 5,
        events=events,
        attached=attached,
    )
    return persister, record, store


def payload(step: int) -> dict:
    return {"model": {"w": torch.full((4,), float(step))}, "progress": {"step": step}}


def kinds(tmp_path) -> list[str]:
    path = tmp_path / "events.jsonl"
    return [e["event"] for e in read_events(str(path))] if path.exists() else []


def test_a_background_save_commits_records_and_applies_retention(tmp_path):
    w, record, store = writer(tmp_path, keep_last=2)
    for step in (10, 20, 30):
        outcome, error = w.save(step, 0, Reason.STEPS, lambda s=step: payload(s), background=True)
        assert (outcome, error) == (SaveOutcome.COMMITTED, None)  # for now: the thread decides
    w.wait()
    assert record.last_committed == 30 and record.failure is None and record.skipped == 0
    assert store.committed_steps() == [20, 30]  # keep_last=2, deleted after the newer commit
    assert kinds(tmp_path).count(Event.CHECKPOINT) == 3


def test_under_warn_a_scheduled_save_storage_refuses_is_skipped_and_a_final_one_fails(tmp_path):
    w, record, store = writer(tmp_path, on_storage_failure="warn")
    w.save(10, 0, Reason.STEPS, lambda: payload(10), background=True)
    w.wait()
    store.down = True
    w.save(20, 0, Reason.STEPS, lambda: payload(20), background=True)
    w.wait()
    assert (record.skipped, record.skipped_step, record.failure) == (1, 20, None)
    assert record.last_committed == 10
    outcome, error = w.save(30, 0, Reason.FINAL, lambda: payload(30), background=False)
    assert outcome is SaveOutcome.FAILED and isinstance(error, storage.StorageUnavailableError)
    assert kinds(tmp_path)[-2:] == [Event.CHECKPOINT_SKIPPED, Event.CHECKPOINT_FAILED]
    store.down = False
    assert store.committed_steps() == [10]


def test_under_fail_a_background_failure_is_recorded_for_the_loop_to_stop_on(tmp_path):
    w, record, store = writer(tmp_path, on_storage_failure="fail")
    store.down = True
    w.save(10, 0, Reason.STEPS, lambda: payload(10), background=True)
    w.wait()
    assert record.failure is not None and record.failure.step == 10 and record.skipped == 0


def test_the_local_tiers_policy_never_stops_a_run_and_says_nothing_at_info(tmp_path, caplog):
    w, record, store = writer(tmp_path, policy=TurnTierOff())
    store.down = True
    with caplog.at_level(logging.INFO):
        w.save(10, 0, Reason.STEPS, lambda: payload(10), background=True)
        w.wait()
    assert record.failure is not None and record.skipped == 1  # the tier turns off at its next copy
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]
    assert Event.CHECKPOINT_FAILED not in kinds(tmp_path)


def test_a_writer_whose_agent_is_gone_never_commits(tmp_path):
    w, record, store = writer(tmp_path, attached=lambda: False)
    with pytest.raises(OrphanedError, match="not committing step 10"):
        w.save(10, 0, Reason.FINAL, lambda: payload(10), background=False)
    assert store.committed_steps() == [] and record.last_committed is None


def test_a_committed_step_that_verifies_is_kept_not_written_again(tmp_path):
    w, record, store = writer(tmp_path)
    w.save(10, 0, Reason.STEPS, lambda: payload(10), background=False)
    before = store.read_manifest(10)
    record.committed(None)  # a new attempt reaching step 10 again
    w.save(10, 0, Reason.STEPS, lambda: payload(99), background=False)
    assert store.read_manifest(10) == before and record.last_committed == 10


def test_no_new_checkpoint_is_written_after_one_failed_for_good(tmp_path):
    """``fail``: once a background persist failed, the next save starts nothing (the loop stops
    the run on the failure) instead of writing into storage that just refused a checkpoint."""

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

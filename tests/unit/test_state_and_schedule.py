from __future__ import annotations

import io

import pytest
import torch

from elastictrain.checkpoint.schedule import CheckpointSchedule
from elastictrain.checkpoint.state import (
    DataFingerprint,
    TrainState,
    capture,
    check_compatible,
    from_bytes,
    restore,
    to_bytes,
)
from elastictrain.errors import CheckpointMismatchError
from elastictrain.observe.events import Event, EventLog, read_events
from elastictrain.toy import ToyModel

FP = DataFingerprint(batch_size=64, dataset_size=4096, seed=0)


def _state(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 10)).sum().backward()
    opt.step()
    return opt, capture(TrainState(model, opt, fingerprint=FP), step=7)


def _fits(model, payload, fingerprint=FP, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    check_compatible(TrainState(model, opt, fingerprint=fingerprint, **kw), payload, "step 7")


def test_roundtrip_restores_everything():
    torch.manual_seed(0)
    model = ToyModel()
    opt, state = _state(model)
    loaded = from_bytes(to_bytes(state))
    model2 = ToyModel()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    state2 = TrainState(model2, opt2, fingerprint=FP)
    check_compatible(state2, loaded, "test")
    assert restore(state2, loaded) == 7
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(
        opt.state_dict()["state"][0]["momentum_buffer"],
        opt2.state_dict()["state"][0]["momentum_buffer"],
    )


def test_shape_mismatch_names_the_key():
    _, state = _state(ToyModel(hidden=10))
    with pytest.raises(
        CheckpointMismatchError, match=r"net1.weight: checkpoint \(10, 10\) vs model \(12, 10\)"
    ):
        _fits(ToyModel(hidden=12), from_bytes(to_bytes(state)))


def test_key_mismatch_names_the_keys():
    _, state = _state(ToyModel(layers=1))
    with pytest.raises(
        CheckpointMismatchError, match=r"missing keys \['extra.0.bias', 'extra.0.weight'\]"
    ):
        _fits(ToyModel(layers=2), from_bytes(to_bytes(state)))


def test_batch_size_change_is_a_mismatch():
    model = ToyModel()
    _, state = _state(model)
    with pytest.raises(CheckpointMismatchError, match="batch_size was 64 when saved, is 32 now"):
        _fits(model, state, DataFingerprint(32, 4096, 0))


def test_loading_refuses_pickled_code():
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    buf = io.BytesIO()
    torch.save({"model": Evil()}, buf)
    with pytest.raises(Exception, match="Weights only load failed"):
        from_bytes(buf.getvalue())


def test_schedule_by_steps_and_time():
    now = [0.0]
    sched = CheckpointSchedule(every_steps=10, every_seconds=5.0, clock=lambda: now[0])
    assert sched.due_by_steps(10) and not sched.due_by_steps(11)
    assert not sched.due_by_time()
    now[0] = 5.0
    assert sched.due_by_time()
    sched.mark_saved()
    assert not sched.due_by_time()
    off = CheckpointSchedule(every_steps=None, every_seconds=None)
    assert not off.due_by_steps(100) and not off.due_by_time() and not off.uses_time


def test_event_log_appends_and_tolerates_torn_line(tmp_path):
    path = str(tmp_path / "sub" / "e.jsonl")
    EventLog(path, enabled=True).emit("start", world_size=2)
    with open(path, "a") as f:
        f.write('{"event": "torn')  # a kill mid-write
    EventLog(path, enabled=True).emit("end", step=3)
    EventLog(path, enabled=False).emit("ignored")
    assert [e["event"] for e in read_events(path)] == ["start", "end"]


def test_progress_reports_rate_eta_and_last_checkpoint(tmp_path, caplog):
    import logging

    from elastictrain.observe.progress import Progress

    path = str(tmp_path / "e.jsonl")
    progress = Progress(
        world_size=2,
        start_step=0,
        max_steps=100,
        every_s=3600,
        events=EventLog(path, enabled=True),
        enabled=True,
    )
    progress.last_checkpoint = 40
    with caplog.at_level(logging.INFO, logger="elastictrain.observe.progress"):
        assert not progress.due()  # inside the interval
        progress.report(50, torch.tensor(0.25))
    (event,) = read_events(path)
    assert (
        event["event"] == Event.PROGRESS
        and event["step"] == 50
        and event["loss"] == 0.25
        and event["steps_per_s"] > 0
    )
    assert (
        "progress 50/100 loss 0.25000" in caplog.text
        and "eta" in caplog.text
        and "last checkpoint 40 world size 2" in caplog.text
    )
    assert "local copy" not in caplog.text  # no local tier: nothing to say
    # A local copy newer than the durable checkpoint is worth a word; an older one is not.
    progress.last_local = 47
    with caplog.at_level(logging.INFO, logger="elastictrain.observe.progress"):
        progress.report(60, torch.tensor(0.25))
        progress.last_checkpoint = 60
        progress.report(70, torch.tensor(0.25))
    first, second = [
        r.getMessage()
        for r in caplog.records
        if "progress 6" in r.getMessage() or "progress 7" in r.getMessage()
    ]
    assert first.endswith("world size 2 local copy 47"), first
    assert second.endswith("world size 2"), second

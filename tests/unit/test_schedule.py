"""elastictrain.checkpoint.schedule: when a checkpoint is due."""

from __future__ import annotations

from elastictrain.checkpoint.schedule import CheckpointSchedule


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

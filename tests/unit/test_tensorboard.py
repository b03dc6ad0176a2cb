"""elastictrain.observe.tensorboard: curves that continue across restarts."""

from __future__ import annotations

import pytest


def test_tensorboard_curves_continue_after_a_restart_without_duplicate_steps(tmp_path):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    from elastictrain.observe.tensorboard import Scalars

    first = Scalars(str(tmp_path), resume_step=0, enabled=True)
    for step in range(1, 11):  # the crashed attempt got to step 10
        first.write(step, "train", {"loss": 1.0})
    first.close()
    second = Scalars(str(tmp_path), resume_step=6, enabled=True)  # resumed from checkpoint 6
    for step in range(7, 13):
        second.write(step, "train", {"loss": 2.0})
    second.close()

    acc = event_accumulator.EventAccumulator(str(tmp_path))
    acc.Reload()
    points = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [s for s, _ in points] == list(range(1, 13)), points
    assert [v for _, v in points] == [1.0] * 6 + [2.0] * 6

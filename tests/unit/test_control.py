"""The per-step decisions: agreed at rank 0's proposed cadence, never lost in between."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from elastictrain.runtime.control import Control


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_cadence_follows_step_time_and_a_late_flag_is_still_seen(one_rank_group):
    control = Control(torch.device("cpu"), is_rank0=True, interval_s=0.05)
    flags = {"stop": False, "by_time": False, "report": False, "persist_failed": False}
    agreed_at = []
    for done in range(1, 200):
        time.sleep(0.002)  # ~2 ms steps: about every 25th step should agree
        if done == 150:
            flags["stop"] = True  # a signal arrives between agreements...
        if done >= control._next:  # this step is an agreed one
            agreed_at.append(done)
        decided = control.agree(done, **flags)
        if decided.stop:
            break
    assert decided.stop and 150 <= done <= 150 + 60  # ...and is acted on at the next one
    gaps = [b - a for a, b in zip(agreed_at[1:], agreed_at[2:], strict=False)]
    assert gaps and 5 <= sorted(gaps)[len(gaps) // 2] <= 40  # not every step, not never


def test_a_spike_step_is_agreed_as_the_earliest_and_none_stays_none(one_rank_group):
    """The spike rides the same all-reduce (MAX of the negated step): a rank's spike at step 0
    is still a spike, and no spike reads back as None, not as a step."""
    control = Control(torch.device("cpu"), is_rank0=True, interval_s=0.0)
    flags = {"stop": False, "by_time": False, "report": False, "persist_failed": False}
    assert control.due(1) and control.agree(1, **flags).spike_step is None
    assert control.agree(2, **flags, spike_step=0).spike_step == 0
    assert control.agree(3, **flags, spike_step=123_456).spike_step == 123_456
    # A background copy refused for a NaN (2) rides it too, so every rank stops with exit 10.
    assert control.agree(4, **{**flags, "persist_failed": 2}).persist_failed == 2


def test_after_a_rollback_the_next_agreement_is_at_once(one_rank_group):
    """A rollback sends the steps back below the agreed cadence's next step: without
    restart_at, a stop signal would wait until the run passed the undone steps again."""
    control = Control(torch.device("cpu"), is_rank0=True, interval_s=60.0)
    flags = {"stop": False, "by_time": False, "report": False, "persist_failed": False}
    control.agree(1, **flags)
    time.sleep(0.01)
    control.agree(2, **flags)  # 10 ms steps: the next agreement is thousands of steps away
    assert not control.due(500)
    control.restart_at(40)
    assert control.due(40)

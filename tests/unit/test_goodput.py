"""elastictrain.observe.goodput: the effective training time of a run and its lost time by cause,
from an event history with one kill and restart (every figure worked out by hand below)."""

from __future__ import annotations

import pytest

from elastictrain.observe.events import Event
from elastictrain.observe.goodput import goodput
from elastictrain.observe.timeline import Outcome, build_timeline, summary


def _history() -> list[dict]:
    return [
        # Attempt 0: started at 0, first step at 2, 0.1 s a step, a checkpoint at step 20 that
        # held the loop 0.1 s; a worker is killed after step 30 and rank 0 says so at 5.5.
        {"event": Event.START, "time": 0.0, "world_size": 2},
        {"event": Event.RESUME, "time": 1.0, "step": 0, "fresh": True},
        {"event": Event.FIRST_STEP, "time": 2.0, "step": 1},
        {"event": Event.PROGRESS, "time": 3.0, "step": 10},
        {"event": Event.CHECKPOINT, "time": 4.0, "step": 20, "blocked_s": 0.1},
        {"event": Event.PROGRESS, "time": 5.0, "step": 30},
        {"event": Event.EXIT, "time": 5.5, "rank": 0, "cause": "DistBackendError"},
        # Attempt 1: torchrun's restart; it resumes from step 20 and trains steps 21-30 again.
        {"event": Event.START, "time": 8.0, "world_size": 2, "restart_count": 1},
        {"event": Event.RESUME, "time": 8.5, "step": 20, "tier": "durable"},
        {"event": Event.FIRST_STEP, "time": 9.0, "step": 21},
        {"event": Event.CHECKPOINT, "time": 15.0, "step": 80, "blocked_s": 0.2},
        {"event": Event.END, "time": 20.0, "step": 100},
    ]


def test_lost_time_by_cause_and_the_effective_ratio_from_one_kill_and_restart():
    g = goodput(build_timeline(_history()))
    assert g.wall_s == 20.0
    assert g.lost_s == pytest.approx(
        {
            "start-up": 2.0 + 1.0,  # each start event to its first completed step
            "detection": 0.5,  # the last step event (5.0) to rank 0's last words (5.5)
            "replacement": 0.0,  # no in-place epoch
            "restart": 2.5,  # to the next start event
            "redone steps": 1.0,  # steps 21-30 again, at attempt 0's 0.1 s a step
            "rolled back": 0.0,  # no rollback
            "checkpoint blocking": 0.3,
            "stragglers": 0.0,  # no rank named
        }
    )
    assert g.ratio == pytest.approx((20 - 7.3) / 20)
    assert g.fields()["effective_training_ratio"] == pytest.approx(0.635)
    assert "effective training time 63.5% of 20.0s wall" in g.line()


def test_a_rollback_costs_the_steps_it_undid_at_the_step_time_and_its_own_seconds():
    """Steps 50-70 trained at 0.1 s a step, a spike rolled back at 70 to the copy of step 60:
    ten steps undone (1.0 s) and the rollback's 0.3 s, in the same attempt; its load's resume
    event does not make the attempt look resumed from 60."""
    history = [
        {"event": Event.START, "time": 0.0, "world_size": 2},
        {"event": Event.RESUME, "time": 1.0, "step": 0, "fresh": True},
        {"event": Event.FIRST_STEP, "time": 2.0, "step": 1},
        {"event": Event.PROGRESS, "time": 6.9, "step": 50},
        {"event": Event.PROGRESS, "time": 8.9, "step": 70},
        {"event": Event.RESUME, "time": 9.1, "step": 60, "tier": "local"},
        {
            "event": Event.ROLLBACK,
            "time": 9.2,
            "step": 60,
            "at_step": 70,
            "reason": "loss spike",
            "skipped": "60-65",
            "retracted": [],
            "seconds": 0.3,
        },  # fmt: skip
        {
            "event": Event.SKIP,
            "time": 9.3,
            "step": 60,
            "reason": "rolled back: loss spike",
            "samples": [1, 2],
        },  # fmt: skip
        {"event": Event.END, "time": 20.0, "step": 100},
    ]
    timeline = build_timeline(history)
    g = goodput(timeline)
    assert g.lost_s["rolled back"] == pytest.approx(10 * 0.1 + 0.3)
    text = summary(timeline)
    assert "steps 0->100" in text and "rolled back at step 70 (loss spike) to step 60" in text
    assert "  skipped step 60 (rolled back: loss spike), 2 samples: [1, 2]" in text.splitlines()


def test_an_uninterrupted_run_loses_only_its_start_up_and_checkpoints():
    events = [e for e in _history() if e["time"] < 5.2] + [
        {"event": Event.END, "time": 6.0, "step": 40}
    ]
    g = goodput(build_timeline(events))
    assert (g.wall_s, g.lost_s["detection"], g.lost_s["restart"], g.lost_s["redone steps"]) == (
        6.0,
        0.0,
        0.0,
        0.0,
    )
    assert g.ratio == pytest.approx((6.0 - 2.0 - 0.1) / 6.0)


def test_an_in_place_recovery_is_its_own_cause_from_its_own_record():
    """--replace-in-place: rank 1's process dies at 5.0 (its record's failed_at), the last
    survivor sees it 0.05 s later, the epoch starts at 5.2 at the step in flight and trains again
    at 5.4. Its time is a replacement, not a restart, and the report says how it began."""
    events = [e for e in _history() if e["time"] < 5.2 and e["event"] != Event.EXIT] + [
        {
            "event": Event.START,
            "time": 5.2,
            "world_size": 2,
            "began": "replaced in place",
            "replaced_ranks": [1],
            "failed_at": 5.0,
            "detected_s": 0.05,
        },
        {"event": Event.RESUME, "time": 5.3, "step": 30, "tier": "live"},
        {"event": Event.FIRST_STEP, "time": 5.4, "step": 31},
        {"event": Event.END, "time": 12.4, "step": 100},
    ]
    timeline = build_timeline(events)
    g = goodput(timeline)
    assert (g.lost_s["detection"], g.lost_s["replacement"], g.lost_s["restart"]) == pytest.approx(
        (0.05, 0.15, 0.0)
    )
    assert g.lost_s["redone steps"] == 0.0  # the step in flight only: it never completed
    first, second = timeline.attempts
    assert first.outcome == Outcome.LOST and second.began == "replaced in place: rank 1"
    assert second.stall_s == pytest.approx(0.4)
    assert "(replaced in place: rank 1; stall 0.40s)" in summary(timeline)


def _work(step: int, time: float, medians: list[float]) -> dict:
    ranks = [{"rank": r, "median_s": m, "score": 1.0} for r, m in enumerate(medians)]
    return {"event": Event.STRAGGLERS, "time": time, "step": step, "ranks": ranks}


def test_a_straggler_costs_its_excess_work_on_every_step_from_its_streaks_start_to_its_eviction():
    """Three ranks, reports every 10 steps; rank 2's work before the sync is 0.05 s against the
    others' 0.01 from the report at step 20 on. Named at step 40 after 3 slow reports (20, 30,
    40), evicted there, its node taken over by a spare. Lost to it: (0.05 - 0.01) s x the 30 steps
    from step 10 to 40 = 1.2 s, a cause of its own; the next epoch says it began by an eviction.
    (Seen failing with the streak not counted back: 0.4 s.)"""
    events = [
        {"event": Event.START, "time": 0.0, "world_size": 3},
        {"event": Event.RESUME, "time": 0.5, "step": 0, "fresh": True},
        {"event": Event.FIRST_STEP, "time": 1.0, "step": 1},
        _work(10, 2.0, [0.01, 0.01, 0.01]),
        _work(20, 3.0, [0.01, 0.011, 0.05]),
        _work(30, 4.5, [0.01, 0.009, 0.05]),
        _work(40, 6.0, [0.01, 0.01, 0.05]),
        {"event": Event.STRAGGLER, "time": 6.0, "step": 40, "rank": 2, "slow": True, "reports": 3},
        {"event": Event.EVICTION, "time": 6.0, "step": 40, "evicted": True, "ranks": [2]},
        {
            "event": Event.START,
            "time": 6.3,
            "world_size": 3,
            "began": "taken over by a spare node in place",
            "replaced_ranks": [2],
            "failed_at": 6.0,
            "detected_s": 0.0,
        },
        {"event": Event.RESUME, "time": 6.4, "step": 40, "tier": "live"},
        {"event": Event.FIRST_STEP, "time": 6.5, "step": 41},
        _work(50, 7.0, [0.01, 0.01, 0.01]),
        {"event": Event.END, "time": 8.0, "step": 60},
    ]
    timeline = build_timeline(events)
    g = goodput(timeline)
    assert g.lost_s["stragglers"] == pytest.approx(0.04 * 30)
    assert timeline.attempts[1].began == (
        "a straggler's node evicted, taken over by a spare node in place: rank 2"
    )

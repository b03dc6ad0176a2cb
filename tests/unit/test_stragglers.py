"""elastictrain.observe.stragglers: per-rank step times."""

from __future__ import annotations

import pytest

from elastictrain.observe.stragglers import StepTimer, StragglerReport, StragglerWatch


def test_step_timer_and_report():
    timer = StepTimer(window=100)
    assert timer.stats() == (0.0, 0.0)
    for i in range(100):
        timer.add(0.01 * (i + 1))
    median, p95 = timer.stats()
    assert median == pytest.approx(0.505) and p95 == pytest.approx(0.95)
    report = StragglerReport(medians=[0.010, 0.031, 0.011], p95s=[0.012, 0.040, 0.013])
    assert report.slowest_rank == 1 and report.wait_s == pytest.approx(0.0205)
    assert report.as_event()["slowest_rank"] == 1
    assert "slowest rank 1" in report.describe()


def _reports(watch, rows):
    """Feed each row of per-rank medians as one report; every change the watch says, in order."""
    return [c for row in rows for c in watch.update(StragglerReport(row, row))]


def test_a_rank_persistently_slower_than_the_others_is_named_once_with_its_host_and_ratio():
    watch = StragglerWatch(["a", "b", "c", "d"])
    slow = [0.010, 0.010, 0.0135, 0.010]  # rank 2 at 1.35x, 3.5 ms a step
    assert _reports(watch, [slow, slow]) == []  # two reports: not yet persistent
    (named,) = _reports(watch, [slow])
    assert (named.rank, named.host, named.slow, named.reports) == (2, "c", True, 3)
    assert named.ratio == pytest.approx(1.35)
    assert "rank 2 on host c takes 1.35x" in named.describe()
    assert named.as_event()["ratio"] == 1.35
    assert _reports(watch, [slow] * 5) == []  # named once, not at every report
    (recovered,) = _reports(watch, [[0.010] * 4])
    assert (recovered.rank, recovered.slow) == (2, False)


def test_at_two_ranks_the_slow_one_is_judged_against_the_other_not_the_job():
    """The job's median of [10, 15] ms is 12.5: 1.2x would hide a rank 1.5x slower."""
    watch = StragglerWatch(None)
    (named,) = _reports(watch, [[0.010, 0.015]] * 3)
    assert (named.rank, named.host) == (1, None) and named.ratio == pytest.approx(1.5)


def test_a_job_wide_slowdown_a_short_slowdown_and_tiny_steps_name_no_one():
    watch = StragglerWatch()
    everyone = [[0.010] * 4, [0.030] * 4, [0.031, 0.030, 0.029, 0.030], [0.030] * 4]
    assert _reports(watch, everyone) == []  # every rank 3x slower together
    blip = [0.010, 0.020, 0.010, 0.010]
    assert _reports(watch, [blip, blip, [0.010] * 4, blip, blip]) == []  # never 3 in a row
    tiny = [0.0002, 0.0006, 0.0002, 0.0002]  # 3x, but 0.4 ms a step: timer noise
    assert _reports(watch, [tiny] * 5) == []


def test_each_ranks_score_is_in_the_periodic_report():
    event = StragglerReport([0.010, 0.020, 0.010], [0.0, 0.0, 0.0]).as_event()
    assert [r["score"] for r in event["ranks"]] == [0.667, 2.0, 0.667]

"""elastictrain.observe.stragglers: per-rank step times."""

from __future__ import annotations

import pytest

from elastictrain.observe.stragglers import StepTimer, StragglerReport


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

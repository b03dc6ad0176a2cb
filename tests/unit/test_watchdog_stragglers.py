from __future__ import annotations

import os
import signal

import pytest

from elastictrain.errors import ConfigError
from elastictrain.observe.stragglers import StepTimer, StragglerReport
from elastictrain.signals import StopSignals, parse_signal
from elastictrain.watchdog import HangWatchdog


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_watchdog_fires_only_past_the_phase_budget():
    clock, fired = Clock(), []
    dog = HangWatchdog(5.0, startup_s=60.0, clock=clock, on_hang=fired.append)
    clock.now = 30.0  # startup (resume, first step) uses its own, longer budget
    assert not dog.check()
    dog.beat(1)
    clock.now = 34.9
    assert not dog.check()
    with dog.phase("checkpoint", 100.0):
        clock.now = 120.0  # a slow save is not a hang
        assert not dog.check()
    clock.now = 125.5
    assert dog.check()
    assert "phase 'training' after step 1" in fired[0] and "--hang-timeout" in fired[0]


def test_watchdog_names_checkpoint_timeout_in_save_phase():
    clock, fired = Clock(), []
    dog = HangWatchdog(5.0, startup_s=1.0, clock=clock, on_hang=fired.append)
    dog.beat(3)
    with dog.phase("checkpoint", 10.0):
        clock.now = 11.0
        assert dog.check()
    assert "phase 'checkpoint'" in fired[0] and "--checkpoint-timeout" in fired[0]


def test_stop_signal_only_sets_a_flag():
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        stop = StopSignals([signal.SIGUSR2])
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.requested and stop.received == signal.SIGUSR2 and stop.received_at is not None
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_parse_signal():
    assert parse_signal("usr1") == signal.SIGUSR1 and parse_signal("SIGTERM") == signal.SIGTERM
    with pytest.raises(ConfigError, match="'SIGNOPE' is not a signal name"):
        parse_signal("SIGNOPE")


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


def test_watchdog_exits_when_the_agent_is_gone(monkeypatch):
    import elastictrain.watchdog as wd

    exits = []
    monkeypatch.setattr(wd, "_orphaned_exit", exits.append)
    parent = [100]
    dog = HangWatchdog(
        60.0, startup_s=60.0, clock=Clock(), agent_pid=100, parent_pid=lambda: parent[0]
    )
    assert not dog.check()
    parent[0] = 1  # reparented to init: the agent died
    assert dog.check() and exits == [100]

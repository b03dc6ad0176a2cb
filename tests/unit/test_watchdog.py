"""elastictrain.watchdog: hang detection and the orphan exit."""

from __future__ import annotations

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

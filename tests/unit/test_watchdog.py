"""elastictrain.runtime.watchdog: hang detection and the orphan exit."""

from __future__ import annotations

from elastictrain.runtime.watchdog import HangWatchdog


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
    dog.beat(2)  # the step after the gate, then the step budget again
    clock.now = 125.5
    assert dog.check()
    assert "phase 'training' after step 2" in fired[0] and "--hang-timeout" in fired[0]


def test_watchdog_names_checkpoint_timeout_in_save_phase():
    clock, fired = Clock(), []
    dog = HangWatchdog(5.0, startup_s=1.0, clock=clock, on_hang=fired.append)
    dog.beat(3)
    with dog.phase("checkpoint", 10.0):
        clock.now = 11.0
        assert dog.check()
    assert "phase 'checkpoint'" in fired[0] and "--checkpoint-timeout" in fired[0]


def test_watchdog_exits_when_the_agent_is_gone(monkeypatch):
    import elastictrain.runtime.watchdog as wd

    exits = []
    monkeypatch.setattr(wd, "_orphaned_exit", exits.append)
    parent = [100]
    dog = HangWatchdog(
        60.0, startup_s=60.0, clock=Clock(), agent_pid=100, parent_pid=lambda: parent[0]
    )
    assert not dog.check()
    parent[0] = 1  # reparented to init: the agent died
    assert dog.check() and exits == [100]


def _steps(dog, clock, first: int, count: int, seconds: float) -> int:
    for step in range(first, first + count):
        clock.now += seconds
        assert not dog.check()
        dog.beat(step)
    return first + count


def test_the_step_budget_learns_the_job_s_step_time_with_a_floor_and_the_timeout_as_ceiling():
    clock, fired = Clock(), []
    dog = HangWatchdog(600.0, startup_s=900.0, floor_s=60.0, clock=clock, on_hang=fired.append)
    clock.now = 180.0  # a 3-minute first step (compilation) is startup's, not a step's
    dog.beat(1)
    step = _steps(dog, clock, 2, 3, 0.5)
    assert dog.step_budget()[0] == 600.0  # still warming up: the fixed budget
    step = _steps(dog, clock, step, 20, 0.5)
    assert dog.step_budget()[0] == 60.0  # 10 x 0.5 s is under the floor
    with dog.phase("waiting for the data loader", 600.0):
        clock.now += 0.2  # this rank's own wait, inside every step: the step is still timed
    dog.beat(step)
    step += 1
    with dog.phase("checkpoint", 900.0, shared=True):
        clock.now += 300.0  # a slow checkpoint gate is its own phase, not a slow step
    # The step after a gate waits for a peer still inside its own (rank 0 on a slow persist, as
    # its heartbeat says): excused up to --hang-timeout, and not timed.
    dog.excuse = lambda: "rank(s) [0] inside a gate"
    clock.now += 200.0
    assert not dog.check()
    dog.beat(step)  # the peer left its gate: the step completes
    step += 1
    dog.excuse = lambda: None
    step = _steps(dog, clock, step, 2, 0.5)
    assert dog.step_budget()[0] == 60.0
    step = _steps(dog, clock, step, 1, 5.0)  # one rank 10x slower for a step: the budget widens
    assert dog.step_budget()[0] == 60.0
    step = _steps(dog, clock, step, 1, 30.0)
    assert dog.step_budget()[0] == 300.0 and "slowest" in dog.step_budget()[1]
    step = _steps(dog, clock, step, 1, 90.0)
    assert dog.step_budget() == (600.0, "--hang-timeout")  # the ceiling
    # A wedge after fast steps is found at the floor, not at --hang-timeout.
    fast = HangWatchdog(600.0, startup_s=900.0, floor_s=60.0, clock=clock, on_hang=fired.append)
    fast.beat(1)
    _steps(fast, clock, 2, 10, 0.5)
    clock.now += 61.0
    assert fast.check() and "budget 60s" in fired[-1] and "--hang-floor" in fired[-1]


def test_without_a_floor_the_step_budget_stays_fixed():
    clock = Clock()
    dog = HangWatchdog(600.0, startup_s=900.0, clock=clock, on_hang=lambda reason: None)
    dog.beat(1)
    _steps(dog, clock, 2, 60, 0.5)
    assert dog.step_budget() == (600.0, "--hang-timeout")


def test_an_excuse_holds_off_the_learned_budget_but_never_the_ceiling():
    clock, fired = Clock(), []
    dog = HangWatchdog(600.0, startup_s=900.0, floor_s=60.0, clock=clock, on_hang=fired.append)
    dog.beat(1)
    _steps(dog, clock, 2, 10, 0.5)
    clock.now += 61.0
    dog.excuse = lambda: "rank(s) [0] inside a gate"
    assert not dog.check()  # a peer in a gate: the learned 60 s is not this wait's budget
    clock.now += 540.0
    assert dog.check() and "budget 60s" in fired[-1]  # past --hang-timeout: a hang all the same


def test_the_budget_learns_when_every_step_waits_for_its_loader():
    """The runner wraps each batch fetch in a phase of its own: that must not stop the timing."""
    clock = Clock()
    dog = HangWatchdog(600.0, startup_s=900.0, floor_s=5.0, clock=clock, on_hang=lambda r: None)
    dog.beat(1)
    for step in range(2, 30):
        with dog.phase("waiting for the data loader", 600.0):
            clock.now += 0.01
        clock.now += 0.1
        dog.beat(step)
    assert dog.step_budget()[0] == 5.0

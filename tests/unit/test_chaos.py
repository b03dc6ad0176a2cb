"""elastictrain.tools.chaos's slow-worker fault: a process slowed from outside, stopped and
continued in turn, and left running when the job ends."""

from __future__ import annotations

import subprocess
import time

from elastictrain.inplace.supervisor import _state
from elastictrain.tools.chaos import Chaos, Throttle


def test_a_throttled_process_is_stopped_and_continued_in_turn_and_left_running():
    """Seen failing with the SIGSTOP left out (never stopped) and with the final SIGCONT left out
    (stopped for good after ``stop``)."""
    proc = subprocess.Popen(["sleep", "30"])
    try:
        throttle = Throttle(proc.pid, factor=2.0, period_s=0.05)
        seen = set()
        deadline = time.monotonic() + 10
        while not ("T" in seen and "S" in seen) and time.monotonic() < deadline:
            seen.add(_state(proc.pid))
            time.sleep(0.003)
        throttle.stop()
        assert {"T", "S"} <= seen
        time.sleep(0.05)
        assert _state(proc.pid) in ("S", "R")  # sleeping again, not stopped
    finally:
        proc.kill()
        proc.wait()


def test_a_throttle_ends_by_itself_when_its_process_exits():
    proc = subprocess.Popen(["true"])
    proc.wait()
    throttle = Throttle(proc.pid, factor=3.0)
    throttle._thread.join(5)
    assert not throttle._thread.is_alive()


def test_unhealthy_node_is_given_at_launch_and_the_timed_faults_still_follow(tmp_path):
    """``unhealthy-node`` sets the self-check's knob in the launched command's environment (its
    whole node), at once; the timed faults after it are injected as before."""
    out = tmp_path / "env.txt"
    command = ["sh", "-c", f'echo "$ELASTICTRAIN_CHAOS_UNHEALTHY" > {out}; sleep 3']
    with open(tmp_path / "job.log", "wb") as log, open(tmp_path / "timeline.txt", "w") as said:
        chaos = Chaos(
            command,
            faults=["unhealthy-node", "kill-agent"],
            first_s=0.5,
            gap_s=(0.1, 0.1),
            timeout_s=20,
            seed=1,
            log=log,
            out=said,
        )
        code = chaos.run()
    assert out.read_text().strip() == "compute"
    assert [fault for _, fault, _ in chaos.injected] == ["unhealthy-node", "kill-agent"]
    assert code == -9  # the "agent" (the shell) was SIGKILLed by the timed fault


def test_nan_and_spike_are_given_at_launch_to_the_named_rank_and_step(tmp_path):
    """``nan`` and ``spike`` set the loop's knobs in the launched command's environment: the step and the
    torchrun rank whose loss goes NaN (``knobs.nan_steps`` reads it back)."""
    out = tmp_path / "env.txt"
    command = ["sh", "-c", f'echo "$ELASTICTRAIN_CHAOS_NAN $ELASTICTRAIN_CHAOS_SPIKE" > {out}']
    with open(tmp_path / "job.log", "wb") as log, open(tmp_path / "timeline.txt", "w") as said:
        chaos = Chaos(
            command,
            faults=["nan", "spike"],
            first_s=0.5,
            gap_s=(0.1, 0.1),
            timeout_s=20,
            seed=1,
            log=log,
            out=said,
            fault_at=(37, 1),
        )
        code = chaos.run()
    assert code == 0 and out.read_text().strip() == "37:1 37:1"
    assert "fault 1: nan -> pid" in (tmp_path / "timeline.txt").read_text()

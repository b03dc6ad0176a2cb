"""Ctrl-C through real torchrun: the first stops gracefully with the step committed, the second
aborts at once. Either way one line per rank, never a traceback."""

from __future__ import annotations

import os
import signal
import time

import storage
from elastictrain.observe.events import Cause, Event, read_events
from tests.helpers.launcher import REPO_ROOT, final_state, toy_args, wait_for_event


def test_first_ctrl_c_commits_the_current_step_and_exits(launch, tmp_path):
    ckpt, ev = str(tmp_path / "c"), str(tmp_path / "ev.jsonl")
    job = launch(toy_args(ckpt, ev, max_steps=5000, every=1000, step_time=0.01), max_restarts=0)
    wait_for_event(ev, lambda e: e["event"] == Event.PROGRESS and e["step"] > 20, 90, job)
    os.kill(job.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends the agent
    job.wait(60)
    log = job.log()
    (preempted,) = [e for e in read_events(ev) if e["event"] == Event.PREEMPTED]
    assert preempted["signal"] == "SIGINT" and 20 < preempted["step"] < 1000, log[-3000:]
    # The step it stopped at is committed, though no checkpoint was scheduled before 1000.
    assert final_state(ckpt)["progress"]["step"] == preempted["step"]
    assert log.count(f"PREEMPTED (SIGINT) at step {preempted['step']}:") == 2, log[-3000:]
    # No worker printed a traceback (theirs would run through this repository's files); the one
    # traceback in the log is torchrun's own SignalException.
    assert "KeyboardInterrupt" not in log and f'File "{REPO_ROOT}' not in log, log[-3000:]


def test_second_ctrl_c_aborts_at_once_and_keeps_the_last_checkpoint(launch, tmp_path):
    ckpt, ev = str(tmp_path / "c"), str(tmp_path / "ev.jsonl")
    # Half-second steps: both signals land inside one step, before the first can be agreed on.
    args = toy_args(ckpt, ev, max_steps=5000, every=4, step_time=0.5)
    job = launch(args, max_restarts=0)
    wait_for_event(ev, lambda e: e["event"] == Event.CHECKPOINT and e["step"] >= 4, 90, job)
    before = storage.open_store(ckpt).committed_steps()
    t0 = time.monotonic()
    os.kill(job.proc.pid, signal.SIGINT)
    time.sleep(0.05)
    os.kill(job.proc.pid, signal.SIGINT)  # the agent turns this one into SIGTERM for workers
    job.wait(30)
    elapsed = time.monotonic() - t0
    log = job.log()
    assert elapsed < 5, f"took {elapsed:.1f}s to abort; log:\n{log[-3000:]}"
    assert log.count("ABORTED: SIGTERM after Ctrl-C; exiting 130") == 2, log[-3000:]  # each rank
    assert "KeyboardInterrupt" not in log and f'File "{REPO_ROOT}' not in log, log[-3000:]
    events = read_events(ev)
    assert not [e for e in events if e["event"] == Event.PREEMPTED]  # no checkpoint waited for
    assert any(e["event"] == Event.EXIT and e["cause"] == Cause.ABORTED for e in events)
    after = storage.open_store(ckpt).committed_steps()
    assert after and set(before) <= set(after) | set(range(min(after)))  # only retention pruned
    assert final_state(ckpt)["progress"]["step"] == max(after)  # the newest one still verifies

"""--replace-in-place: a SIGKILLed training process is replaced by its rank's spare while the
other ranks keep their processes and their state; torchrun never sees a failure."""

from __future__ import annotations

import time

import pytest

import storage
from elastictrain.observe.events import Event, read_events
from tests.helpers.kill_during_persist import TOY, _wait_half_written
from tests.helpers.launcher import assert_bitwise_equal, final_state, toy_args, wait_for_event

STEPS = 160
TOY_ARGS = tuple(a for opt in TOY for a in ("--task-option", opt))  # ~40 MB: a persist to aim at


def _epoch_began(n: int):
    """The first completed step of membership epoch ``n`` (its n-th first_step event)."""
    seen = []
    return lambda e: e["event"] == Event.FIRST_STEP and (seen.append(e) or len(seen) > n)


@pytest.mark.slow
def test_killed_training_processes_are_replaced_in_place_bitwise(launch, tmp_path):
    """Rank 1's training process SIGKILLed mid-step, then rank 0's while its background persist
    is half-written: the survivors keep their pids, torchrun restarts nothing (--max-restarts 0),
    and the torn checkpoint is never committed. Then both, the second during the first's
    recovery: the epoch falls back to the checkpoints. The final state equals an uninterrupted
    run's."""
    ref_dir = str(tmp_path / "ref")
    ref_args = toy_args(ref_dir, str(tmp_path / "ref.jsonl"), max_steps=STEPS, every=1000)
    ref = launch([*ref_args, "--task-option", "step_time=0", *TOY_ARGS], name="ref")
    run_dir, ev = str(tmp_path / "run"), str(tmp_path / "run.jsonl")
    extra = ("--replace-in-place", "--no-local-checkpoint", "--keep-last", "2", *TOY_ARGS)
    job = launch(
        toy_args(run_dir, ev, max_steps=STEPS, every=10, step_time=0, extra=extra),
        max_restarts=0,
        name="in-place",
    )
    wait_for_event(ev, _epoch_began(0), 120, job)
    killed = [job.kill_training_process(ev, rank=1, epoch=0)]
    wait_for_event(ev, _epoch_began(1), 60, job)
    torn = _wait_half_written(run_dir, 60, job)
    killed.append(job.kill_training_process(ev, rank=0, epoch=1))
    # Both processes, 50 ms apart: the second dies while the first's recovery runs, so no
    # survivor holds the state and the epoch resumes from the checkpoints.
    wait_for_event(ev, _epoch_began(2), 60, job)
    job.kill_training_process(ev, rank=1, epoch=2)
    time.sleep(0.05)
    job.kill_training_process(ev, rank=0, epoch=2)
    assert job.wait(180) == 0, job.log()[-3000:]
    assert ref.wait(120) == 0, ref.log()[-3000:]

    events = read_events(ev)
    starts = [e for e in events if e["event"] == Event.START]
    pids = [[pid for _, pid in e["processes"]] for e in starts]
    assert [e["restart_count"] for e in starts] == [0, 0, 0, 0], starts
    assert [e.get("replaced_ranks") for e in starts] == [None, [1], [0], [0, 1]]
    # Survivors keep their processes; each replacement is a new one.
    assert pids[1][0] == pids[0][0] and pids[2][1] == pids[1][1], pids
    assert pids[1][1] not in pids[0] and pids[2][0] not in pids[1], pids
    assert killed == [pids[0][1], pids[1][0]]
    resumes = [e for e in events if e["event"] == Event.RESUME]
    assert [e.get("tier") for e in resumes[1:]] == ["live", "live", "durable"]
    assert resumes[1]["remote_bytes"] == resumes[2]["remote_bytes"] == 0
    assert starts[3]["began"] == "replaced, from the checkpoints"
    # Only the step in flight is redone: each epoch resumes at the newest step a survivor held.
    progress = [e["step"] for e in events if e["event"] == Event.FIRST_STEP]
    assert [p - 1 for p in progress[1:3]] == [e["step"] for e in resumes[1:3]]
    store = storage.open_store(run_dir)
    assert torn not in store.committed_steps()
    assert events[-1]["event"] == Event.END and events[-1]["step"] == STEPS
    assert_bitwise_equal(final_state(run_dir), final_state(ref_dir))


def test_a_death_that_recurs_at_one_step_ends_the_job_with_a_clear_error(launch, tmp_path):
    """Rank 1 dies every time it trains step 30. Replaced once, it dies there again: every rank
    stops with an error that says so, and torchrun's restart stops at once too (the verdict is
    kept in its store), instead of replacing and restarting until a budget runs out."""
    ev = str(tmp_path / "ev.jsonl")
    crash = ("crash_rank=1", "crash_step=30")
    extra = ["--replace-in-place", "--task", "tests.helpers.recurring_crash:make_task"]
    extra += [a for opt in crash for a in ("--task-option", opt)]
    job = launch(toy_args(str(tmp_path / "c"), ev, step_time=0, extra=tuple(extra)), max_restarts=1)
    assert job.wait(120) != 0
    log = job.log()
    assert log.count("died twice at step 30") >= 2, log[-3000:]  # both ranks, each attempt
    starts = [e for e in read_events(ev) if e["event"] == Event.START]
    # The first epoch and its one replacement; the second replacement and torchrun's restart
    # stop before training.
    assert [e["restart_count"] for e in starts] == [0, 0], starts
    assert "RecurringFailureError" in log

"""SIGKILL workers of a real torchrun job; the resumed run must end bit-for-bit equal."""

from __future__ import annotations

import random
import time

import pytest

from elastictrain.checkpoint.api import Reason, Tier
from elastictrain.observe.events import Event, read_events, read_sample_log
from tests.helpers.committed_files import CommittedFiles
from tests.helpers.launcher import (
    assert_bitwise_equal,
    final_state,
    run_single,
    toy_args,
    wait_for_event,
)


# 3 workers: where DDP's bucket order decides gloo's summation order (a sum of two is
# order-independent). Two workers SIGKILLed and bitwise equal: the digits and library-mode tests.
@pytest.mark.slow
@pytest.mark.parametrize("nproc", [3])
def test_sigkill_workers_resume_bitwise(launch, tmp_path, nproc):
    ref_dir, ref_ev = str(tmp_path / "ref"), str(tmp_path / "ref.jsonl")
    ref = launch(toy_args(ref_dir, ref_ev), nproc=nproc, name="ref", plain=True)
    assert ref.wait(180) == 0, ref.log()[-3000:]

    run_dir, ev = str(tmp_path / "run"), str(tmp_path / "run.jsonl")
    # The durable tier alone: resumes land on its steps (the local tier's kill is on S3, below).
    durable_only = toy_args(run_dir, ev, extra=("--no-local-checkpoint",))
    with CommittedFiles(run_dir) as committed:  # kills, restarts, retention: write-once holds
        job = launch(durable_only, nproc=nproc, max_restarts=3, name="killed")
        rng = random.Random(1000 + nproc)
        # Kill 1: right after the first checkpoint commits.
        wait_for_event(ev, lambda e: e["event"] == Event.CHECKPOINT, 90, job)
        job.kill_worker(rng.randrange(nproc))
        # Kill 2: at a random moment after the restarted group resumed from a checkpoint.
        wait_for_event(ev, lambda e: e["event"] == Event.RESUME and not e["fresh"], 90, job)
        time.sleep(rng.uniform(0.1, 1.0))
        job.kill_worker(rng.randrange(nproc))
        assert job.wait(180) == 0, job.log()[-3000:]
    committed.check()

    events = read_events(ev)
    starts = [e for e in events if e["event"] == Event.START]
    resumes = [e for e in events if e["event"] == Event.RESUME]
    assert [e["restart_count"] for e in starts] == [0, 1, 2]
    # Each epoch names every rank's training process; a restart through torchrun replaces all.
    pids = [[pid for _, pid in e["processes"]] for e in starts]
    assert all(len(set(p)) == nproc for p in pids), pids
    assert not set(pids[0]) & set(pids[1]) and not set(pids[1]) & set(pids[2]), pids
    assert resumes[0]["fresh"] and not resumes[1]["fresh"] and not resumes[2]["fresh"]
    assert 40 <= resumes[1]["step"] <= resumes[2]["step"] < 300
    assert resumes[1]["step"] % 40 == 0 and resumes[2]["step"] % 40 == 0
    assert events[-1]["event"] == Event.END and events[-1]["step"] == 300
    assert_bitwise_equal(final_state(run_dir), final_state(ref_dir))
    print(
        f"\nnproc={nproc}: 2 SIGKILLs, resumed from steps {[e['step'] for e in resumes]}, bitwise equal"
    )


def test_time_based_checkpoints_follow_rank0s_clock_alone(launch, tmp_path):
    """Rank 1's clock runs far ahead (it always thinks a checkpoint is due); rank 0's decides.
    Saves are synchronous, so a rank acting on its own clock would meet another rank's step
    all-reduce with its save barrier and crash; one whose opinion counted would save at nearly
    every agreement instead of once a second."""
    ev = str(tmp_path / "ev.jsonl")
    args = toy_args(str(tmp_path / "c"), ev, max_steps=400, every=0, step_time=0.01)
    args += ["--checkpoint-every-seconds", "1", "--no-async-checkpoint"]
    args += ["--task", "tests.helpers.skewed_clock:make_task"]
    job = launch(args, max_restarts=0, plain=True)
    assert job.wait(120) == 0, job.log()[-3000:]
    events = read_events(ev)
    reasons = [e["reason"] for e in events if e["event"] == Event.CHECKPOINT]
    (first,) = [e for e in events if e["event"] == Event.FIRST_STEP]
    (end,) = [e for e in events if e["event"] == Event.END]
    trained_s = end["time"] - first["time"]
    assert reasons[-1] == Reason.FINAL, reasons
    assert 2 <= reasons.count(Reason.TIME) <= trained_s / 1.0 + 1, (reasons, trained_s)


@pytest.mark.slow
def test_user_task_example_trains_and_resumes(tmp_path):
    """The README's task example, one process (resume under torchrun is the other tests' job)."""
    args = [
        "--task",
        "examples.regression_task:make_task",
        "--checkpoint-dir",
        str(tmp_path / "c"),
        "--event-log",
        str(tmp_path / "ev.jsonl"),
        "--max-steps",
        "60",
        "--checkpoint-every-steps",
        "20",
    ]
    first = run_single([*args, "--max-steps", "40"], str(tmp_path))
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_single(args, str(tmp_path))
    assert second.returncode == 0, second.stderr[-3000:]
    resumes = [e for e in read_events(str(tmp_path / "ev.jsonl")) if e["event"] == Event.RESUME]
    assert [e["step"] for e in resumes] == [0, 40]
    progress = [e for e in read_events(str(tmp_path / "ev.jsonl")) if e["event"] == Event.PROGRESS]
    assert progress[-1]["step"] == 60 and progress[-1]["loss"] < progress[0]["loss"]
    # The last plain progress line (logs are not a terminal) names the final checkpoint.
    assert "progress 60/60" in second.stderr and "last checkpoint 60 world size" in second.stderr


@pytest.mark.slow
def test_worker_sigkill_resumes_from_the_local_tier_reading_no_state_from_s3(
    launch, tmp_path, s3_bucket
):
    """The durable tier is a real S3 endpoint (moto_server behind a recording proxy); the local
    tier copies every 10 steps. SIGKILL rank 0 (the writer of both) at a random moment: the restart
    resumes from the local copy, no state file is read from S3 afterwards (only listings and
    manifests), at most the local interval is redone, and the run ends bitwise equal."""
    from tests.helpers.elastic import committed_history
    from tests.helpers.fault_proxy import FaultProxy

    bucket_url, options = s3_bucket
    ref = launch(
        toy_args(str(tmp_path / "ref"), str(tmp_path / "ref.jsonl"), max_steps=200, step_time=0),
        name="ref",
        plain=True,
    )
    assert ref.wait(120) == 0
    url, ev, samples = f"{bucket_url}/run", str(tmp_path / "run.jsonl"), str(tmp_path / "samples")
    with FaultProxy(options["endpoint_url"]) as proxy:
        opts = {**options, "endpoint_url": proxy.url}
        extra = [a for k, v in opts.items() for a in ("--storage-option", f"{k}={v}")]
        extra += ["--local-every-steps", "10", "--sample-log", samples]
        job = launch(toy_args(url, ev, max_steps=200, step_time=0.01, extra=tuple(extra)))
        wait_for_event(ev, lambda e: e["event"] == Event.CHECKPOINT, 90, job)
        time.sleep(random.Random(17).uniform(0.05, 0.3))
        seen = len(proxy.requests)
        job.kill_worker(0)  # rank 0: the writer of both tiers
        assert job.wait(180) == 0, job.log()[-3000:]
        after_kill = proxy.requests[seen:]
    state_reads = [p for m, p in after_kill if m == "GET" and "/state-" in p]
    assert not state_reads, state_reads
    assert any("manifest.json" in p for _, p in after_kill)  # it did look at the durable tier
    resumes = [e for e in read_events(ev) if e["event"] == Event.RESUME]
    assert resumes[0]["fresh"]
    resumed = resumes[1]
    assert (resumed["tier"], resumed["remote_bytes"], resumed["source_rank"]) == (Tier.LOCAL, 0, 0)
    assert resumed["step"] >= resumed["durable_step"] >= 40 and resumed["step"] % 10 == 0
    # Redone: what the killed attempt had trained past the copy it resumed from.
    history = read_sample_log(samples)
    killed = min(e["generation"] for e in history)  # the first attempt's
    trained = max(e["step"] for e in history if e["generation"] == killed) + 1
    redone = trained - resumed["step"]
    assert 0 <= redone <= 10 + 1, (trained, resumed)  # the interval, plus a copy in flight
    assert sorted(committed_history(history)) == list(range(200))
    assert_bitwise_equal(
        final_state(url, storage_options=options), final_state(str(tmp_path / "ref"))
    )
    print(
        f"\nresumed from local step {resumed['step']}: {redone} steps redone, 0 state bytes from S3"
    )

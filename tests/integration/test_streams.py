"""Streaming datasets (``Task.dataset`` an ``IterableDataset``) under torchrun: exact resume after
kills at the same world size, with and without loader workers; exactly-once across a world-size
change for a stream that can seek; and the refusals (exit 2, nothing written or changed)."""

from __future__ import annotations

import os

import pytest

from elastictrain.observe.events import Event, read_events, read_sample_log
from tests.helpers.elastic import assert_exactly_once
from tests.helpers.launcher import assert_bitwise_equal, final_state, toy_args, wait_for_event
from tests.helpers.paths import checkpoint_files

STREAM = ("--task", "tests.helpers.stream_task:make_task")
BATCH = 12


@pytest.mark.slow
@pytest.mark.parametrize("workers, rank", [(0, 1), (2, 0)])
def test_stream_killed_resumes_bitwise_equal(launch, tmp_path, workers, rank):
    """A stateful stream (no seek) at 2 ranks, one rank SIGKILLed after the first checkpoint: the
    run ends bit for bit equal to an uninterrupted one, with in-process loading and with 2
    loader workers (whose own dataset states are restored by torchdata)."""
    extra = (*STREAM, "--task-option", "stream=stateful", "--num-workers", str(workers))

    def args(ckpt: str, step_time: float) -> list[str]:
        return toy_args(
            ckpt, ckpt + ".jsonl", max_steps=40, every=10, step_time=step_time, extra=extra
        )

    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
    ref = launch(args(ref_dir, 0), name="ref", plain=True)
    job = launch(args(run_dir, 0.03), name="run")
    ev = run_dir + ".jsonl"
    wait_for_event(ev, lambda e: e["event"] == Event.CHECKPOINT, 120, job)
    job.kill_worker(rank)
    assert job.wait(180) == 0, job.log()[-3000:]
    assert ref.wait(180) == 0, ref.log()[-3000:]
    resumes = [e for e in read_events(ev) if e["event"] == Event.RESUME]
    assert [e["fresh"] for e in resumes] == [True, False], resumes
    assert 10 <= resumes[-1]["step"] < 40, resumes  # it resumed mid-stream, from a checkpoint
    assert_bitwise_equal(final_state(run_dir), final_state(ref_dir))


@pytest.mark.slow
def test_stream_ledger_is_exactly_once_across_a_world_size_change_or_the_resume_is_refused(
    launch, tmp_path
):
    """A seekable stream trains 30 steps at 2 ranks, then on at 3: the ledger holds every sample
        of the first 50 * 12 exactly once. A stream without seek, resumed at 3, stops with exit 2 and
        one message, and every file of its checkpoints is byte for byte what it was (the run's history, events/,
    records why the start failed)."""
    runs = {}
    for kind in ("seekable", "stateful"):
        ckpt = str(tmp_path / kind)
        extra = (*STREAM, "--task-option", f"stream={kind}", "--sample-log", ckpt + "-ledger")
        runs[kind] = (ckpt, extra)
        job = launch(
            toy_args(ckpt, ckpt + ".jsonl", max_steps=30, every=10, step_time=0, extra=extra),
            name=kind,
            plain=True,
        )
        assert job.wait(120) == 0, job.log()[-3000:]
    ckpt, extra = runs["stateful"]
    before = checkpoint_files(ckpt)
    refused = launch(
        toy_args(ckpt, ckpt + ".jsonl", max_steps=50, every=10, step_time=0, extra=extra),
        nproc=3,
        max_restarts=0,
        name="refused",
        plain=True,
    )
    assert refused.wait(120) != 0
    log = refused.log()
    assert "FAILED (exit 2): CheckpointMismatchError" in log and "no seek" in log, log[-3000:]
    assert "Nothing was loaded or changed" in log and "relaunch at data-parallel size 2" in log
    assert checkpoint_files(ckpt) == before  # the run's history (events/) records the refusal

    ckpt, extra = runs["seekable"]
    wider = launch(
        toy_args(ckpt, ckpt + ".jsonl", max_steps=50, every=10, step_time=0, extra=extra),
        nproc=3,
        name="wider",
        plain=True,
    )
    assert wider.wait(120) == 0, wider.log()[-3000:]
    ledger = assert_exactly_once(
        read_sample_log(ckpt + "-ledger"), dataset_size=50 * BATCH, batch_size=BATCH, max_steps=50
    )
    assert ledger["world_sizes"] == [2, 3], ledger


def test_a_plain_iterable_dataset_stops_at_start_with_exit_2_writing_nothing(launch, tmp_path):
    ckpt = str(tmp_path / "never")
    job = launch(
        [*STREAM, "--task-option", "stream=plain", "--checkpoint-dir", ckpt],
        max_restarts=0,
        plain=True,
    )
    assert job.wait(120) != 0
    errors = [line for line in job.log().splitlines() if "FAILED (exit 2)" in line]
    assert errors and all("IterableDataset (PlainStream) without state_dict()" in e for e in errors)
    assert not os.path.exists(ckpt)

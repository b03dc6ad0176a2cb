"""Numerical faults (``train.numerics``): a step whose gradient is not finite is skipped on every
rank and never applied, bitwise as a run told ``--skip-steps``; too many in a row stop the job,
naming the steps and samples, with nothing non-finite committed."""

from __future__ import annotations

import math

import pytest
import torch

import storage
from elastictrain import load_checkpoint
from elastictrain.errors import EXIT_NUMERICAL
from elastictrain.observe.events import Event, read_events, read_sample_log
from elastictrain.observe.history import merge_lines
from elastictrain.observe.timeline import build_timeline, summary
from tests.helpers.elastic import assert_exactly_once, skipped_steps
from tests.helpers.launcher import assert_bitwise_equal, final_state, job_env, toy_args

STEPS = 120
BATCH = 64


def _args(tmp_path, name: str, *extra: str) -> list[str]:
    args = toy_args(str(tmp_path / name), str(tmp_path / f"{name}.jsonl"), max_steps=STEPS)
    return [
        *args,
        "--checkpoint-every-steps",
        "25",
        "--sample-log",
        str(tmp_path / f"{name}-s"),
        *extra,
    ]


def _skips(tmp_path, name: str) -> list[dict]:
    return [e for e in read_events(str(tmp_path / f"{name}.jsonl")) if e["event"] == Event.SKIP]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_nan_on_one_rank_is_skipped_on_every_rank_bitwise_as_a_run_told_to_skip(
    launch, tmp_path, parallel
):
    """Rank 1's loss is NaN at step 60 (its gradient, then every rank's reduced one): no rank
    applies the step, its 64 samples are recorded as skipped, and the run ends bitwise equal to
    one told --skip-steps 60. FSDP reads the verdict from every rank's shards."""
    layout = ("--parallel", parallel)
    faulted = launch(
        _args(tmp_path, "faulted", *layout),
        env=job_env(ELASTICTRAIN_CHAOS_NAN="60:1"),
        name="faulted",
        plain=True,
    )
    told = launch(_args(tmp_path, "told", *layout, "--skip-steps", "60"), name="told", plain=True)
    assert faulted.wait(120) == 0, faulted.log()[-3000:]
    assert told.wait(120) == 0, told.log()[-3000:]

    [skip] = _skips(tmp_path, "faulted")
    assert (skip["step"], skip["reason"], skip["loss_not_finite_on"]) == (
        60,
        "non-finite gradient",
        [1],
    )
    [named] = _skips(tmp_path, "told")
    assert (named["step"], named["reason"], named["loss_not_finite_on"]) == (60, "--skip-steps", [])
    assert skip["samples"] == named["samples"] and len(skip["samples"]) == BATCH
    ledger = read_sample_log(str(tmp_path / "faulted-s"))
    assert skipped_steps(ledger) == {60: "non-finite gradient"}
    assert_exactly_once(ledger, dataset_size=4096, batch_size=BATCH, max_steps=STEPS)
    assert_bitwise_equal(
        final_state(str(tmp_path / "faulted")), final_state(str(tmp_path / "told"))
    )
    # The report lists the skipped samples (and the loss plot marks the step).
    lines = merge_lines([(tmp_path / "faulted.jsonl").read_text()])
    listed = f"  skipped step 60 (non-finite gradient), 64 samples: {skip['samples']}"
    assert listed in summary(build_timeline(lines)).splitlines()


def test_nans_in_a_row_past_the_limit_stop_the_job_naming_them_with_nothing_non_finite_committed(
    launch, tmp_path
):
    """Steps 40-43 all NaN with --max-consecutive-skips 3: the fourth stops every rank with
    exit 10, the message names the steps, samples and the --skip-steps that would skip them;
    every committed checkpoint is finite."""
    job = launch(
        _args(tmp_path, "run", "--max-consecutive-skips", "3"),
        env=job_env(ELASTICTRAIN_CHAOS_NAN="40-43:0"),
        plain=True,
    )
    assert job.wait(120) == EXIT_NUMERICAL, job.log()[-3000:]
    log = job.log()
    assert "NumericalFaultError: steps 40-43 had a non-finite loss or gradient, 4 in a row" in log
    assert "relaunch with --skip-steps 40-43" in log
    skips = _skips(tmp_path, "run")
    assert [(s["step"], s["in_a_row"]) for s in skips] == [(40, 1), (41, 2), (42, 3), (43, 4)]
    assert f"step 40: [{', '.join(map(str, skips[0]['samples'][:16]))}, ...] (64)" in log
    url = str(tmp_path / "run")
    assert storage.open_store(url).committed_steps() == [25]
    for step in storage.open_store(url).committed_steps():
        state = load_checkpoint(url, step=step)
        for name, t in state["model"].items():
            assert torch.isfinite(t).all(), (step, name)
    assert not any(
        math.isnan(e.get("loss") or 0.0)
        for e in read_events(str(tmp_path / "run.jsonl"))
        if e["event"] == Event.PROGRESS
    )

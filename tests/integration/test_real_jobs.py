"""What real jobs add (randomness, precision, accumulation, extra state, loader workers), each
SIGKILLed mid-run under torchrun: the resumed run must end bit-for-bit equal to an uninterrupted
one, extra state included."""

from __future__ import annotations

import random
import time

import pytest
import torch

from elastictrain.observe.events import Event, read_events
from tests.helpers.launcher import (
    assert_bitwise_equal,
    final_state,
    run_single,
    toy_args,
    wait_for_event,
)

RICH = ("--task", "tests.helpers.rich_task:make_task")

# Two jobs, each combining features that do not share state (each job costs about 30 s of CPU
# in the suite): what must resume exactly is the sum of their states, and a feature lost on resume
# fails its job. fp16 and bf16 cannot share one. The digits full job (test_examples.py) has all
# but fp16 at once.
MATRIX = {
    # dropout masks, an EMA in Task.state, random/NumPy noise in loss_fn, task metrics and eval;
    # bf16 autocast, with batches drawn in loader worker processes
    "dropout-ema-random-bf16-loader-workers": (
        *(*RICH, "--eval-every-steps", "40"),
        *("--precision", "bf16", "--num-workers", "2", "--prefetch-factor", "4"),
    ),
    # GradScaler's scale and growth tracker, under accumulation and clipping
    "fp16-gradscaler-accum4-clip": (
        *("--precision", "fp16", "--grad-accum-steps", "4", "--clip-grad-norm", "0.5"),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MATRIX))
def test_sigkill_resume_is_bitwise_equal(launch, tmp_path, name):
    extra = MATRIX[name]
    # The reference and the killed run side by side: the same seed, world size and flags.
    ref = launch(
        toy_args(str(tmp_path / "ref"), str(tmp_path / "ref.jsonl"), max_steps=160, extra=extra),
        name="ref",
        plain=True,
    )
    ev = str(tmp_path / "run.jsonl")
    job = launch(
        toy_args(str(tmp_path / "run"), ev, max_steps=160, extra=extra), name=f"killed-{name}"
    )
    wait_for_event(ev, lambda e: e["event"] == Event.CHECKPOINT, 90, job)
    time.sleep(random.Random(name).uniform(0.1, 0.6))  # mid-interval, not at a checkpoint
    job.kill_worker(1)
    assert job.wait(180) == 0, job.log()[-3000:]
    assert ref.wait(180) == 0, ref.log()[-3000:]

    resumes = [e for e in read_events(ev) if e["event"] == Event.RESUME]
    assert [e["fresh"] for e in resumes] == [True, False], resumes
    assert 40 <= resumes[1]["step"] < 160
    run, reference = final_state(str(tmp_path / "run")), final_state(str(tmp_path / "ref"))
    assert_bitwise_equal(run, reference)
    assert run.get("stateful", {}).keys() == reference.get("stateful", {}).keys()
    for key in run.get("stateful", {}):
        shadow = run["stateful"][key]["shadow"]
        assert all(
            torch.equal(v, reference["stateful"][key]["shadow"][k]) for k, v in shadow.items()
        )
        assert run["stateful"][key]["updates"] == 160
    progress = [e for e in read_events(ev) if e["event"] == Event.PROGRESS]
    if "fp16" in name:
        assert run["scaler"] == reference["scaler"] and run["scaler"]["scale"] > 0
        assert all("overflow_skips" in e for e in progress)
        assert "overflow_skips" in read_events(ev)[-1]  # the end event's total
    if "clip" in name:
        assert all(e["grad_norm"] > 0 for e in progress), progress
    if "ema" in name:  # the task's metric, and its evaluation every 40 steps + the end
        assert all("mae" in e["metrics"] for e in progress), progress
        evals = [e["step"] for e in read_events(ev) if e["event"] == Event.EVAL]
        assert set(evals) == {40, 80, 120, 160}, evals
    print(f"\n{name}: resumed from step {resumes[1]['step']}, bitwise equal")


FAULTY = ("--task", "tests.helpers.rich_task:make_faulty_loader_task", "--num-workers", "2")


def test_a_crashed_loader_worker_fails_the_attempt_with_a_clear_error(tmp_path):
    """Exit 1 with an error that names the loader: torchrun restarts the group (as after any
    crash). Torch reports a dead worker from its SIGCHLD handler wherever the rank is (usually
    mid-step: "DataLoader worker (pid N) exited unexpectedly"); caught while waiting for a batch,
    the error may be a bare ConnectionResetError, which the loader names as a DataLoadError."""
    args = ["--checkpoint-dir", str(tmp_path / "c"), "--max-steps", "50", *FAULTY]
    result = run_single([*args, "--task-option", "fault=crash"], cwd=str(tmp_path))
    assert result.returncode == 1, result.stderr[-3000:]
    named = "failed (2 loader workers (--num-workers))" in result.stderr
    assert named or "exited unexpectedly" in result.stderr, result.stderr[-3000:]
    assert ls_steps(tmp_path / "c") == []  # nothing committed was touched (there was none)


def test_a_crash_prints_its_traceback_and_exits_without_interpreter_teardown(tmp_path):
    """A bug's exception leaves the runner like any other failure: printed, exit 1, and no
    interpreter teardown, whose exit hooks (multiprocessing joining loader workers) can block."""
    args = ["--checkpoint-dir", str(tmp_path / "c"), "--max-steps", "50", *FAULTY]
    result = run_single([*args, "--task-option", "fault=bug"], cwd=str(tmp_path), timeout=60)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" in result.stderr and "ValueError: a bug in the loss" in result.stderr


def test_a_hung_loader_worker_is_a_hang_exit_4_naming_the_loader(tmp_path):
    args = ["--checkpoint-dir", str(tmp_path / "c"), "--max-steps", "50", "--hang-timeout", "3"]
    result = run_single([*args, *FAULTY, "--task-option", "fault=hang"], cwd=str(tmp_path))
    assert result.returncode == 4, result.stderr[-3000:]
    assert "HANG DETECTED" in result.stderr
    assert "in phase 'waiting for the data loader'" in result.stderr
    assert "from --hang-timeout" in result.stderr


def ls_steps(path) -> list[int]:
    import os

    return sorted(int(n.split("-")[1]) for n in os.listdir(path) if n.startswith("step-"))


def test_tensorboard_scalars_continue_across_a_resume_without_duplicate_steps(tmp_path):
    """The runner end to end: a run stopped at step 30 and resumed to 60 draws one curve."""
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    tb = str(tmp_path / "tb")
    args = [*RICH, "--checkpoint-dir", str(tmp_path / "c"), "--tensorboard", tb]
    args += [
        "--log-every-seconds",
        "0.05",
        "--eval-every-steps",
        "20",
        "--task-option",
        "step_time=0.005",
    ]
    for max_steps in ("30", "60"):
        done = run_single([*args, "--max-steps", max_steps], cwd=str(tmp_path))
        assert done.returncode == 0, done.stderr[-3000:]
    acc = event_accumulator.EventAccumulator(tb)
    acc.Reload()
    for tag in ("train/loss", "train/mae", "eval/mse"):
        steps = [e.step for e in acc.Scalars(tag)]
        assert steps == sorted(set(steps)) and steps[-1] == 60, (tag, steps)
    assert [e.step for e in acc.Scalars("eval/mse")] == [20, 30, 40, 60]

"""FSDP2 sharded checkpoints through real torchrun jobs on CPU/gloo: resharding at other world
sizes, bitwise resume after kills (one while shards are being written), fallback past a corrupt,
missing or truncated shard, and export of the consolidated model."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest
import torch

from elastictrain.__main__ import main as cli_main
from elastictrain.checkpoint.api import Tier
from elastictrain.checkpoint.sharded import format as sharded
from elastictrain.observe.events import Event, read_events
from storage.manifest import MANIFEST_NAME, parse_step_dir, step_dir_name
from tests.helpers.launcher import (
    assert_bitwise_equal,
    final_state,
    run_single,
    toy_args,
    wait_for_event,
    wait_for_fast_copies,
)
from tests.helpers.paths import flip_a_byte

FSDP = ("--parallel", "fsdp")
RICH = ("--task", "tests.helpers.rich_task:make_task", "--task-option", "step_time=0")
PROBE = ("-m", "tests.helpers.fsdp_probe")


def _shards(step_dir: str) -> list[str]:
    return sorted(f for f in os.listdir(step_dir) if f.startswith("shard-") and f.endswith(".bin"))


def _index_format(step_dir: str) -> str:
    (name,) = [f for f in os.listdir(step_dir) if f.startswith("index-")]
    with open(os.path.join(step_dir, name)) as f:
        return json.load(f)["format"]


@pytest.mark.slow
def test_fsdp_checkpoint_saved_at_2_resumes_at_1_and_3_with_exact_state(launch, tmp_path):
    ckpt, ref = str(tmp_path / "ckpt"), str(tmp_path / "saved.pt")
    saver = launch(["save", ckpt, ref, "12"], nproc=2, entry=PROBE, name="save", plain=True)
    assert saver.wait(120) == 0, saver.log()[-3000:]
    assert len(_shards(os.path.join(ckpt, step_dir_name(12)))) == 2
    # Real FSDP2 shards follow the row rule, so the index lists tensors, not chunks (format 2).
    assert _index_format(os.path.join(ckpt, step_dir_name(12))) == sharded.RULE_INDEX_FORMAT
    jobs = {}
    for world in (1, 3):  # both at once: each on its own copy
        copy = str(tmp_path / f"at-{world}")
        shutil.copytree(ckpt, copy)
        jobs[world] = launch(
            ["resume", copy, ref, "3"], nproc=world, entry=PROBE, name=f"at-{world}", plain=True
        )
    for world, job in jobs.items():
        assert job.wait(120) == 0, job.log()[-3000:]
        seen = json.loads(job.log().split("PROBE ", 1)[1].splitlines()[0])
        assert seen == {"world_size": world, "resumed": 12, "differs": [], "tensors": 24}, seen
        # Training went on at the new size: its checkpoint has one shard per rank.
        assert len(_shards(os.path.join(str(tmp_path / f"at-{world}"), step_dir_name(15)))) == world
        at = os.path.join(str(tmp_path / f"at-{world}"), step_dir_name(15))
        assert _index_format(at) == sharded.RULE_INDEX_FORMAT  # uneven rows at 3 ranks too


def _kill_while_shards_are_written(job, ckpt: str, after: int, timeout: float) -> int:
    """SIGKILL rank 1 the moment its shard of a step after ``after`` is on disk but its report,
    written once the shard is durable, is not: rank 1 is writing it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []:
            step_dir = os.path.join(ckpt, name)
            step = parse_step_dir(name)
            if step is None or step <= after:
                continue
            files = set(os.listdir(step_dir)) if os.path.isdir(step_dir) else set()
            # Its shard being written (a temporary name until it is whole) or written, and its
            # table not yet published.
            writing = any(f.startswith(("shard-r00001", ".shard-r00001")) for f in files) and not (
                any(f.startswith("part-r00001") for f in files)
            )
            if writing and MANIFEST_NAME not in files:
                job.kill_worker(1)
                return step
        time.sleep(0.002)
    raise AssertionError(f"no shard was ever caught mid-write; log:\n{job.log()[-2000:]}")


@pytest.mark.slow
def test_fsdp_sigkilled_twice_once_mid_shard_write_then_preempted_ends_bitwise_equal(
    launch, tmp_path, committed_files
):
    # ~10 MB of sharded state (weights + momentum), so a shard write takes a moment; fast
    # copies at the durable tier's steps, so a kill between checkpoints resumes from node memory.
    model = (*FSDP, "--task-option", "hidden=512", "--task-option", "layers=3")
    extra = (*model, "--local-every-steps", "20", "--local-checkpoint-dir", str(tmp_path / "shm"))
    # The reference keeps no copies in node memory: it would write the job's own copy folders.
    ref = launch(
        toy_args(
            str(tmp_path / "ref"),
            str(tmp_path / "ref.jsonl"),
            max_steps=160,
            every=20,
            step_time=0,
            extra=(*model, "--no-local-checkpoint"),
        ),
        name="ref",
        plain=True,
    )
    ev, ckpt = str(tmp_path / "run.jsonl"), str(tmp_path / "run")
    args = toy_args(ckpt, ev, max_steps=160, every=20, step_time=0.015, extra=extra)
    watched = committed_files(ckpt, tmp_path / "shm")  # kills mid-write, a preemption: write-once
    job = launch(args)
    first = wait_for_event(ev, lambda e: e["event"] == Event.CHECKPOINT, 90, job)
    caught = _kill_while_shards_are_written(job, ckpt, first["step"], 90)
    resumed = wait_for_event(ev, lambda e: e["event"] == Event.RESUME and not e["fresh"], 90, job)
    durable = wait_for_event(
        ev, lambda e: e["event"] == Event.CHECKPOINT and e["time"] > resumed["time"], 90, job
    )
    # Both ranks' fast copies of that step are committed too (they are written in the background,
    # at their own pace): the second kill then has a fast step as new as the durable one.
    copies = ["own-r00000", "own-r00001"]
    wait_for_fast_copies(str(tmp_path / "shm"), copies, ckpt, durable["step"], 90, job)
    job.kill_worker(0)  # the second kill: rank 0, between checkpoints
    third = wait_for_event(
        ev, lambda e: e["event"] == Event.RESUME and e["time"] > resumed["time"], 90, job
    )
    wait_for_event(
        ev,
        lambda e: e["event"] == Event.PROGRESS and e["time"] > third["time"] and e["step"] % 20,
        90,
        job,
    )
    os.kill(job.proc.pid, signal.SIGTERM)  # then a preemption, through the agent
    job.wait(90)
    assert "PREEMPTED (SIGTERM)" in job.log() and "exit 75" in job.log(), job.log()[-3000:]
    preempted = [e for e in read_events(ev) if e["event"] == Event.PREEMPTED]
    assert len(preempted) == 1
    again = launch(args, name="relaunch")
    assert again.wait(240) == 0, again.log()[-3000:]
    watched.check()
    assert ref.wait(240) == 0, ref.log()[-3000:]

    resumes = [e for e in read_events(ev) if e["event"] == Event.RESUME]
    assert [e["fresh"] for e in resumes] == [True, False, False, False], resumes
    assert resumes[-1]["step"] == preempted[0]["step"]  # the preemption lost zero steps
    # The step caught mid-write commits only if rank 1's write completed in the instant before the
    # kill; either way resume picked a step that verified, and nothing was found corrupt.
    assert resumes[1]["step"] <= caught and "CORRUPT CHECKPOINT" not in job.log()
    # The kill between checkpoints: every rank's shards from its node's memory, none from storage.
    assert (resumes[2]["tier"], resumes[2]["remote_bytes"]) == (Tier.FAST, 0), resumes[2]
    assert resumes[2]["local_bytes"] > 0 and resumes[2]["peer_bytes"] == 0, resumes[2]
    assert_bitwise_equal(final_state(ckpt), final_state(str(tmp_path / "ref")))


@pytest.fixture(scope="module")
def committed(tmp_path_factory):
    """An FSDP job at world size 2 with checkpoints at steps 10, 20, 30 and 40 (the rich task:
    EMA, dropout), shared by the corruption and export tests: each works on its own copy."""
    from tests.helpers.launcher import Job

    root = tmp_path_factory.mktemp("fsdp")
    ckpt = str(root / "ckpt")
    job = Job(
        ["--standalone", "--nproc_per_node=2", "--max-restarts=0"],
        [
            *RICH,
            *FSDP,
            "--checkpoint-dir",
            ckpt,
            "--max-steps",
            "40",
            "--checkpoint-every-steps",
            "10",
            "--keep-last",
            "5",
        ],
        str(root / "job.log"),
        cwd=str(root),
    )
    try:
        assert job.wait(120) == 0, job.log()[-3000:]
    finally:
        job.kill()
    return ckpt


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def test_a_flipped_truncated_or_deleted_shard_falls_back_to_the_previous_step(
    launch, tmp_path, committed
):
    """Step 40 has a flipped byte in rank 1's shard (found by the block digests while reading),
    30 a truncated one and 20 a deleted one (both found by the size check): one resume falls back
    past each, in turn, to step 10."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(committed, ckpt)
    for step, damage in ((40, flip_a_byte), (30, _truncate), (20, os.unlink)):
        step_dir = os.path.join(ckpt, step_dir_name(step))
        damage(os.path.join(step_dir, _shards(step_dir)[1]))
    ev = str(tmp_path / "ev.jsonl")
    job = launch(
        [
            *RICH,
            *FSDP,
            "--checkpoint-dir",
            ckpt,
            "--event-log",
            ev,
            "--max-steps",
            "45",
            "--checkpoint-every-steps",
            "10",
        ],
        max_restarts=0,
    )
    assert job.wait(120) == 0, job.log()[-3000:]
    assert job.log().count("CORRUPT CHECKPOINT") >= 3
    assert "does not match its digest" in job.log()  # the flip, by rank 1's ranged read
    events = read_events(ev)
    assert [e["step"] for e in events if e["event"] == Event.CORRUPT] == [40, 30, 20], events
    resume = next(e for e in events if e["event"] == Event.RESUME)
    assert resume["step"] == 10 and not resume["fresh"], resume
    # Training reached 40 again and replaced the corrupt checkpoint with a good one.
    out = run_single(["verify", ckpt, "--step", "40"], cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr


def test_export_gives_the_model_its_checkpoint_holds(tmp_path, committed, capsys):
    safetensors = pytest.importorskip("safetensors.torch")
    from tests.helpers.rich_task import make_task

    state = final_state(committed)  # consolidated from both ranks' shards
    x = torch.randn(7, 10)
    expected = make_task({})
    expected.model.load_state_dict(state["model"])
    outputs = []
    for name in ("model.safetensors", "model.pt"):
        # The CLI in this process (as `python -m elastictrain ...` runs it): no torch start-up.
        assert cli_main(["export", committed, "-o", str(tmp_path / name)]) == 0
        assert "exported step 40" in capsys.readouterr().out
        loaded = (
            safetensors.load_file(str(tmp_path / name))
            if name.endswith(".safetensors")
            else torch.load(str(tmp_path / name), weights_only=True)
        )
        model = make_task({}).model.eval()
        model.load_state_dict(loaded)  # strict: exactly the unwrapped model's keys
        outputs.append(model(x))
    expected.model.eval()
    for out in outputs:
        assert torch.equal(out, expected.model(x))
    # The CLI shows the shards: how many per checkpoint, and per tensor.
    assert cli_main(["ls", committed, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [(r["shards"], r["verified"]) for r in rows] == [(2, True)] * 4, rows
    assert cli_main(["inspect", committed, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    weight = next(t for t in shown["tensors"] if t["name"] == "model.0.weight")
    assert weight["shape"] == [32, 10] and weight["shards"] == 2
    # And it is the trained model, not a fresh one.
    assert not torch.equal(outputs[0], make_task({}).model.eval()(x))
    assert sharded.is_sharded_checkpoint(state["manifest"])

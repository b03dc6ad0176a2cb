"""Resume from foreign-device checkpoints, fall back past corruption, and fail clearly on bad input."""

from __future__ import annotations

import glob
import io
import json
import os
import subprocess
import sys

import pytest
import torch

import storage
from elastictrain.checkpoint.state import flat as staging
from elastictrain.checkpoint.state.train_state import from_bytes, state_file_of
from elastictrain.observe.events import Event, read_events
from tests.helpers.launcher import (
    REPO_ROOT,
    assert_bitwise_equal,
    final_state,
    job_env,
    run_single,
    toy_args,
)
from tests.helpers.paths import checkpoint_files


def _save_with_location(state: dict, location: str) -> bytes:
    """torch.save whose storages claim to live on ``location`` (e.g. cuda:1), as a GPU job writes."""
    original = torch.serialization.location_tag
    torch.serialization.location_tag = lambda storage: location
    try:
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()
    finally:
        torch.serialization.location_tag = original


@pytest.mark.slow
def test_gpu_saved_checkpoints_resume_on_this_ranks_device(launch, tmp_path):
    """Both formats a run may find: the flat ``state-g*.bin`` the runner writes (it records no
    device at all; ``map_location`` places every tensor, optimizer state included) and a
    ``torch.save`` file whose tensors are tagged ``cuda:1`` (older elastictrain, or by hand).
    The jobs are hidden from any GPU, so this runs, and means the same, on every machine."""
    cpu_only = job_env(CUDA_VISIBLE_DEVICES="")
    ref_dir, gpu_dir = str(tmp_path / "ref"), str(tmp_path / "gpu")
    ref_args = toy_args(ref_dir, str(tmp_path / "ref.jsonl"), max_steps=120, every=60, step_time=0)
    ref = launch(ref_args, env=cpu_only, name="ref", plain=True)
    assert ref.wait(120) == 0

    # The runner's own file: flat, and nothing in it names a device.
    ckpt = storage.open_store(ref_dir).read(60)  # kept by retention (--keep-last 3)
    name = state_file_of(ckpt.manifest.metadata)
    flat = bytes(ckpt.files[name])
    assert name.startswith("state-g") and staging.is_flat(flat)
    tail = flat[_tensor_bytes_end(flat) :]  # the skeleton and header: all but tensor bytes
    assert b"cpu" not in tail and b"cuda" not in tail
    on_meta = staging.load(flat, map_location="meta")
    tensors = [*on_meta["model"].values(), *on_meta["optimizer"]["state"][0].values()]
    assert tensors and all(t.device.type == "meta" for t in tensors)

    # A torch.save file whose tensors carry cuda:1 tags, as a GPU job of older versions wrote.
    state = from_bytes(flat)
    blob = _save_with_location(state, "cuda:1")
    if torch.cuda.device_count() < 2:  # proof the tags are real: without a remap, no load
        with pytest.raises(RuntimeError, match="CUDA|cuda"):
            torch.load(io.BytesIO(blob), weights_only=True)
    metadata = {**ckpt.manifest.metadata, "state_file": "state.pt"}
    storage.open_store(gpu_dir).commit(60, {"state.pt": blob}, metadata)

    # The flat file's own resume is every other resume test; this one resumes the tagged file.
    ev = str(tmp_path / "gpu.jsonl")
    job = launch(
        toy_args(gpu_dir, ev, max_steps=120, every=60, step_time=0), env=cpu_only, plain=True
    )
    assert job.wait(120) == 0, job.log()[-3000:]
    assert [e["step"] for e in read_events(ev) if e["event"] == Event.RESUME] == [60]
    assert_bitwise_equal(final_state(gpu_dir), final_state(ref_dir))


def _tensor_bytes_end(flat: bytes) -> int:
    """Where the tensor bytes of a flat file end (its skeleton and header follow)."""
    header_end = len(flat) - staging._TRAILER.size
    header_len, _ = staging._TRAILER.unpack_from(flat, header_end)
    header = json.loads(flat[header_end - header_len : header_end])
    return header_end - header_len - header["skeleton_bytes"]


@pytest.mark.slow
def test_corrupted_latest_falls_back_to_previous(launch, tmp_path):
    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
    ref = launch(
        toy_args(ref_dir, str(tmp_path / "ref.jsonl"), max_steps=150, every=50, step_time=0),
        name="ref",
        plain=True,
    )
    assert ref.wait(120) == 0
    first = launch(
        toy_args(run_dir, str(tmp_path / "a.jsonl"), max_steps=100, every=50, step_time=0),
        name="a",
        plain=True,
    )
    assert first.wait(120) == 0
    (path,) = glob.glob(os.path.join(run_dir, "step-000000000100", "state-g*"))
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))  # one flipped bit

    ev = str(tmp_path / "b.jsonl")
    job = launch(toy_args(run_dir, ev, max_steps=150, every=50, step_time=0), name="b", plain=True)
    assert job.wait(120) == 0, job.log()[-3000:]
    assert "CORRUPT CHECKPOINT" in job.log() and "checkpoint step 100" in job.log()
    assert [e["step"] for e in read_events(ev) if e["event"] == Event.RESUME] == [50]
    # Step 100 was re-trained and re-committed over the corrupt one; everything now verifies.
    listed = storage.open_store(run_dir).list()
    assert [c.step for c in listed] == [50, 100, 150] and all(c.ok for c in listed)
    assert_bitwise_equal(final_state(run_dir), final_state(ref_dir))


def test_bad_task_fails_fast_and_clearly(tmp_path):
    result = run_single(
        ["--task", "no_such_pkg.tasks:build", "--checkpoint-dir", str(tmp_path / "c")],
        str(tmp_path),
    )
    assert result.returncode == 2
    assert "cannot import module 'no_such_pkg.tasks'" in result.stderr
    assert "Traceback" not in result.stderr


def test_unreachable_checkpoint_url_fails_fast_and_clearly(tmp_path, s3_endpoint):
    from tests.helpers.net import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    args = [
        "--checkpoint-dir",
        "s3://no-such-bucket/run",
        "--storage-option",
        f"endpoint_url={dead}",
        "--storage-option",
        "key=AKIAEXAMPLE",
        "--storage-option",
        "secret=hunter2",
        "--max-steps",
        "5",
    ]
    result = run_single(args, str(tmp_path), timeout=120)
    assert result.returncode == 2
    assert "Checkpoint location 's3://no-such-bucket/run' is not usable" in result.stderr
    assert "hunter2" not in result.stderr
    # A reachable endpoint with a missing bucket is a different, equally clear error.
    args[3] = f"endpoint_url={s3_endpoint}"
    result = run_single(args, str(tmp_path), timeout=120)
    assert (
        result.returncode == 2
        and "is not usable" in result.stderr
        and "hunter2" not in result.stderr
    )


def test_bad_credentials_fail_fast_before_any_compute(tmp_path, s3_auth):
    args = [
        "--checkpoint-dir",
        f"s3://{s3_auth.bucket}/run",
        "--storage-option",
        f"endpoint_url={s3_auth.endpoint}",
        "--storage-option",
        "key=AKIANOSUCHKEY0000000",
        "--storage-option",
        "secret=hunter2-secret",
        "--event-log",
        str(tmp_path / "ev.jsonl"),
    ]
    result = run_single(args, str(tmp_path), timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "rejected the credentials (InvalidAccessKeyId)" in result.stderr
    assert "hunter2" not in result.stderr + result.stdout
    assert "hunter2" not in (tmp_path / "ev.jsonl").read_text()
    assert not [e for e in read_events(str(tmp_path / "ev.jsonl")) if e["event"] == Event.PROGRESS]


def test_unknown_protocol_fails_clearly(tmp_path):
    result = run_single(["--checkpoint-dir", "nosuch://x/y"], str(tmp_path))
    assert result.returncode == 2 and "protocol 'nosuch' is not available" in result.stderr


def test_mismatched_checkpoint_fails_clearly_and_deletes_nothing(tmp_path):
    ckpt = str(tmp_path / "c")
    ok = run_single(
        ["--checkpoint-dir", ckpt, "--max-steps", "20", "--checkpoint-every-steps", "10"],
        str(tmp_path),
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    before = checkpoint_files(ckpt)
    bad = run_single(
        ["--checkpoint-dir", ckpt, "--max-steps", "40", "--task-option", "hidden=12"], str(tmp_path)
    )
    assert bad.returncode == 2
    assert "CheckpointMismatchError" in bad.stderr
    assert "net1.weight: checkpoint (10, 10) vs model (12, 10)" in bad.stderr
    assert checkpoint_files(ckpt) == before
    assert sorted({p.split("/")[0] for p in before}) == [
        "fence.json",
        "step-000000000010",
        "step-000000000020",
    ]
    # The failed start is in the run's history: its last words name the error.
    exits = [n for n in os.listdir(os.path.join(ckpt, "events")) if n.startswith("exit-")]
    with open(os.path.join(ckpt, "events", exits[0])) as f:
        assert '"detail": "Checkpoint step 20' in f.read() and len(exits) == 1


def test_full_run_on_s3_and_ls(tmp_path, s3_bucket):
    bucket_url, options = s3_bucket
    url = f"{bucket_url}/run"
    opts = [a for k, v in options.items() for a in ("--storage-option", f"{k}={v}")]
    result = run_single(
        [
            "--checkpoint-dir",
            url,
            *opts,
            "--max-steps",
            "30",
            "--checkpoint-every-steps",
            "10",
            "--keep-last",
            "2",
        ],
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ls = subprocess.run(
        [sys.executable, "-m", "elastictrain", "ls", url, "--json", *opts],
        cwd=REPO_ROOT,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    import json

    doc = json.loads(ls.stdout)
    assert [c["step"] for c in doc["checkpoints"]] == [20, 30]
    assert all(
        c["verified"] and c["world_size"] == 1 and c["bytes"] > 0 for c in doc["checkpoints"]
    )
    state = final_state(url, storage_options=options)
    assert state["progress"]["step"] == 30 and "net1.weight" in state["model"]


def test_lowering_max_steps_below_checkpoint_saves_nothing(tmp_path):
    ckpt = str(tmp_path / "c")
    assert (
        run_single(
            ["--checkpoint-dir", ckpt, "--max-steps", "20", "--checkpoint-every-steps", "0"],
            str(tmp_path),
        ).returncode
        == 0
    )
    again = run_single(["--checkpoint-dir", ckpt, "--max-steps", "10"], str(tmp_path))
    assert again.returncode == 0 and "past --max-steps 10; nothing to do" in again.stderr
    assert storage.open_store(ckpt).committed_steps() == [20]


class _Evil:
    """Unpickling this would run a shell command that creates a marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_checkpoint_is_refused_and_never_executed(tmp_path):
    ckpt, marker = str(tmp_path / "c"), str(tmp_path / "PWNED")
    buf = io.BytesIO()
    torch.save({"model": _Evil(marker), "progress": {"step": 5}}, buf)
    storage.open_store(ckpt).commit(5, {"state.pt": buf.getvalue()}, {"step": 5, "world_size": 1})
    result = run_single(["--checkpoint-dir", ckpt, "--max-steps", "10"], str(tmp_path))
    assert result.returncode == 2
    assert "UnsafeCheckpointError" in result.stderr and "Nothing was executed" in result.stderr
    assert not os.path.exists(marker)
    assert storage.open_store(ckpt).committed_steps() == [5]  # refused, not deleted


def test_a_newer_format_stops_every_rank_with_exit_2_and_touches_nothing(launch, tmp_path):
    """Rank 0 finds it; every rank raises the same error (not a peer's broken collective), and
    the checkpoint is not skipped as corrupt, fenced over or deleted."""
    import shutil

    from storage.manifest import FORMAT_VERSION

    ckpt = tmp_path / "c"
    shutil.copytree(os.path.join(REPO_ROOT, "tests", "fixtures", "format1", "ddp"), ckpt)
    manifest = ckpt / "step-000000000003" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["format_version"] = FORMAT_VERSION + 1
    manifest.write_text(json.dumps(doc))
    before = checkpoint_files(str(ckpt))
    job = launch(
        ["--checkpoint-dir", str(ckpt), "--max-steps", "10"], nproc=2, max_restarts=0, plain=True
    )
    assert job.wait(120) != 0
    log = job.log()
    for rank in (0, 1):
        line = f"[rank {rank} | step -] FAILED (exit 2): NewerFormatError: Checkpoint"
        assert line in log, log[-3000:]
    assert "newer than this elastictrain reads" in log
    assert checkpoint_files(str(ckpt)) == before

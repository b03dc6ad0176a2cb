"""Resume reads the checkpoint from storage once per job (rank 0 broadcasts), unless asked not to."""

from __future__ import annotations

import os

import pytest

import storage
from elastictrain.observe.events import Event, read_events
from storage.hashing import PIPELINE_BYTES
from tests.helpers.counting_fs import bytes_read
from tests.helpers.launcher import job_env


@pytest.mark.parametrize(
    "mode,expected_ratio,hidden",
    [
        ("rank0", 1.0, 90_000),  # 10.8 MB: over the 8 MB line, read in chunks through a file
        ("all", 3.0, 256),  # a small payload: one cat_file per rank
    ],
)
def test_bytes_read_per_resume_at_world_size_3(launch, tmp_path, mode, expected_ratio, hidden):
    root = str(tmp_path / "ckpt")
    url = f"counting://{root}"
    common = [
        "--task",
        "tests.helpers.counting_fs:make_task",
        "--task-option",
        f"hidden={hidden}",
        "--checkpoint-dir",
        url,
        "--storage-option",
        "auto_mkdir=1",
        "--checkpoint-every-steps",
        "0",
        "--event-log",
        str(tmp_path / "ev.jsonl"),
    ]
    first = launch([*common, "--max-steps", "20"], nproc=3, name="first")
    assert first.wait(120) == 0, first.log()[-3000:]
    (size,) = [f.size for f in storage.open_store(root).read(20).manifest.files.values()]
    assert (size >= PIPELINE_BYTES) == (hidden > 256)  # both read paths are covered

    log = str(tmp_path / "reads.tsv")
    second = launch(
        [*common, "--max-steps", "30", "--resume-read", mode],
        nproc=3,
        env=job_env(COUNTING_FS_LOG=log),
        name="second",
    )
    assert second.wait(120) == 0, second.log()[-3000:]
    assert [
        e["step"] for e in read_events(str(tmp_path / "ev.jsonl")) if e["event"] == Event.RESUME
    ] == [0, 20]
    ratio = bytes_read(log, os.path.join("step-000000000020", "state-g")) / size
    print(f"\nresume-read={mode}: {ratio:.3f}x the checkpoint ({size} bytes) read at world size 3")
    assert ratio == pytest.approx(expected_ratio, abs=0.01)

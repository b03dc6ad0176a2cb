"""Resume reads the checkpoint from storage once per job (rank 0 broadcasts), unless asked not to."""

from __future__ import annotations

import os
import shutil

import pytest

import storage
from elastictrain.observe.events import Event, read_events
from storage.hashing import PIPELINE_BYTES
from tests.helpers.counting_fs import bytes_read
from tests.helpers.launcher import job_env, run_single


@pytest.mark.slow
def test_bytes_read_per_resume_at_world_size_3(launch, tmp_path):
    """One 10.8 MB checkpoint (over the 8 MB line, so it is read in chunks through a file), resumed
    at world size 3 in each mode from its own copy: ``rank0`` reads it once, ``all`` three times."""
    common = ["--task", "tests.helpers.counting_fs:make_task", "--task-option", "hidden=90000"]
    # A toy 90,000 wide diverges at the default lr 0.01 (NaN by step 6; the runner now rolls it
    # back, then stops with exit 10): at 0.001 it trains, and the bytes read are the same.
    common += ["--task-option", "lr=0.001"]
    common += ["--storage-option", "auto_mkdir=1", "--checkpoint-every-steps", "0"]
    root = str(tmp_path / "ckpt")
    # Written by one process (a replicated checkpoint is the same at any world size): no agent.
    first = run_single([*common, "--checkpoint-dir", root, "--max-steps", "20"], str(tmp_path))
    assert first.returncode == 0, first.stderr[-3000:]
    (size,) = [f.size for f in storage.open_store(root).read(20).manifest.files.values()]
    assert size >= PIPELINE_BYTES  # the chunked read path, not one cat_file

    runs = {}
    for mode in ("rank0", "all"):  # side by side, each on its own copy
        copy, ev, log = (str(tmp_path / f"{name}-{mode}") for name in ("ckpt", "ev", "reads"))
        shutil.copytree(root, copy)
        runs[mode] = (
            launch(
                [*common, "--checkpoint-dir", f"counting://{copy}", "--max-steps", "30"]
                + ["--resume-read", mode, "--event-log", ev],
                nproc=3,
                env=job_env(COUNTING_FS_LOG=log),
                name=f"second-{mode}",
                plain=True,
            ),
            ev,
            log,
        )
    for mode, expected_ratio in (("rank0", 1.0), ("all", 3.0)):
        second, ev, log = runs[mode]
        assert second.wait(120) == 0, second.log()[-3000:]
        assert [e["step"] for e in read_events(ev) if e["event"] == Event.RESUME] == [20]
        ratio = bytes_read(log, os.path.join("step-000000000020", "state-g")) / size
        print(f"\nresume-read={mode}: {ratio:.3f}x the checkpoint ({size} bytes) at world size 3")
        assert ratio == pytest.approx(expected_ratio, abs=0.01), mode

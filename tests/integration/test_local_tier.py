"""The local checkpoint tier through real torchrun: it turns itself off cleanly where it lacks room.

The kills aimed at its writes are in ``test_kill_during_persist`` (tier ``local``), the worker kill
that must read nothing remote and end bitwise equal in ``test_kill_resume``, the node loss whose
survivor resumes from its own copy in ``test_multinode``.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from elastictrain.observe.events import Event, read_events
from storage import open_store


def _can_mount_a_private_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = "mount -t tmpfs -o size=8k tmpfs /dev/shm"
    return (
        subprocess.run(["unshare", "-rm", "sh", "-c", probe], capture_output=True).returncode == 0
    )


@pytest.mark.skipif(
    not _can_mount_a_private_tmpfs(), reason="needs unshare -rm (user and mount namespaces)"
)
def test_a_dev_shm_too_small_turns_the_local_tier_off_and_the_run_goes_on(launch, tmp_path):
    """/dev/shm is an 8 kB tmpfs, private to the job (a user + mount namespace), and the default
    local folder is used: one INFO line and one ``local_tier`` event say why the tier is off,
    no local copy is attempted, and the durable tier checkpoints and finishes as always."""
    tiny = "mount -t tmpfs -o size=8k tmpfs /dev/shm && exec env -u ELASTICTRAIN_LOCAL_ROOT "
    run = tiny + 'torchrun --standalone --nproc_per_node=1 --max-restarts=0 -m elastictrain "$@"'
    ev, ckpt = str(tmp_path / "ev.jsonl"), str(tmp_path / "ckpt")
    args = ["--checkpoint-dir", ckpt, "--event-log", ev, "--max-steps", "30"]
    job = launch(
        [*args, "--checkpoint-every-steps", "10", "--local-every-steps", "2"],
        script=["unshare", "-rm", "sh", "-c", run, "sh"],
    )
    assert job.wait(120) == 0, job.log()[-3000:]
    events = read_events(ev)
    off = [e for e in events if e["event"] == Event.LOCAL_TIER]
    assert len(off) == 1 and not off[0]["enabled"], off
    assert off[0]["dir"].startswith("/dev/shm/elastictrain-"), off
    assert (
        "free, and the tier needs" in off[0]["why"] and "2 kept + 1 being written" in off[0]["why"]
    )
    assert "local checkpoint tier off: /dev/shm/elastictrain-" in job.log()
    assert not [e for e in events if e["event"] == Event.LOCAL_CHECKPOINT]
    assert open_store(ckpt).committed_steps() == [10, 20, 30]
    assert events[-1]["event"] == Event.END and events[-1]["step"] == 30

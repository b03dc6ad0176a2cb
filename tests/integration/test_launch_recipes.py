"""The launch recipes run for real on this machine: the SLURM batch script under stand-in ``srun``
and ``scontrol`` (one node, so the script's own logic runs: MASTER_ADDR, the signal handling and
the requeue), and the plain-hosts script with this host as the head."""

from __future__ import annotations

import os
import signal

import pytest

from elastictrain.observe.events import Event, read_events
from tests.helpers.launcher import REPO_ROOT, descendants, final_state, job_env, wait_for_event
from tests.helpers.net import free_port

SBATCH = os.path.join(REPO_ROOT, "examples", "slurm", "train.sbatch")
JOB_ID = "4242"

# srun on one node runs its command once; scontrol answers hostnames and records everything else.
FAKE_SRUN = '#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n'
FAKE_SCONTROL = """#!/usr/bin/env bash
if [ "$1 $2" = "show hostnames" ]; then echo 127.0.0.1; else echo "$*" >> "$SCONTROL_LOG"; fi
"""


@pytest.fixture
def slurm_env(tmp_path):
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return job_env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SCONTROL_LOG=str(tmp_path / "scontrol.log"),
        SLURM_JOB_NODELIST="node[01]",
        SLURM_JOB_NAME="et",
        SLURM_JOB_ID=JOB_ID,
        SLURM_NNODES="1",
        MIN_NODES="1",
        SLURM_GPUS_ON_NODE="2",  # two CPU workers stand in for the GPUs
        MASTER_PORT=str(free_port()),
        CHECKPOINT_DIR=str(tmp_path / "ckpt"),
    )


def scontrol_calls(tmp_path) -> list[str]:
    log = tmp_path / "scontrol.log"
    return log.read_text().splitlines() if log.exists() else []


def signal_like_slurm(job, how: str) -> None:
    """``usr1``: the time-limit warning, to the batch shell only (``--signal=B:USR1``).
    ``preempt``: SIGTERM to every process of the job at once, as SLURM's preemption does."""
    if how == "usr1":
        os.kill(job.proc.pid, signal.SIGUSR1)
        return
    for pid in [job.proc.pid, *descendants(job.proc.pid)]:
        os.kill(pid, signal.SIGTERM)


@pytest.mark.slow
def test_sbatch_script_saves_requeues_and_resumes(launch, tmp_path, slurm_env):
    """One job's life under the batch script: the time-limit warning (USR1 to the batch shell),
    a requeue, then a preemption (SIGTERM to every process), another requeue, and the end. Each
    stop commits the exact step and requeues once; each requeued run resumes from that step."""
    events, ckpt = str(tmp_path / f"events-{JOB_ID}.jsonl"), slurm_env["CHECKPOINT_DIR"]
    saved, requeues = 0, []
    for how in ("usr1", "preempt"):
        job = launch(["--task-option", "step_time=0.01"], script=["bash", SBATCH], env=slurm_env)
        wait_for_event(
            events, lambda e, s=saved: e["event"] == Event.PROGRESS and e["step"] >= s + 20, 90, job
        )
        signal_like_slurm(job, how)
        code = job.wait(60)
        log = job.log()
        preempted = [e for e in read_events(events) if e["event"] == Event.PREEMPTED]
        assert preempted[-1]["signal"] == ("SIGUSR1" if how == "usr1" else "SIGTERM"), log[-3000:]
        assert len(preempted) == len(requeues) + 1, log[-3000:]
        if saved:  # this run resumed from the previous stop's step, not from an earlier one
            resumes = [e for e in read_events(events) if e["event"] == Event.RESUME]
            assert resumes[-1]["step"] == saved and not resumes[-1]["fresh"]
        saved = preempted[-1]["step"]
        requeues.append(f"requeue {JOB_ID}")
        assert code != 0 and scontrol_calls(tmp_path) == requeues, log[-3000:]
        assert final_state(ckpt)["progress"]["step"] == saved

    # The last requeued run: same script, same job id; it resumes from the preempted step and ends.
    again = launch(
        ["--max-steps", str(saved + 30)], script=["bash", SBATCH], env=slurm_env, name="requeued"
    )
    assert again.wait(90) == 0, again.log()[-3000:]
    resumes = [e for e in read_events(events) if e["event"] == Event.RESUME]
    assert resumes[-1]["step"] == saved and not resumes[-1]["fresh"]
    assert scontrol_calls(tmp_path) == requeues  # a finished job is not requeued
    assert final_state(ckpt)["progress"]["step"] == saved + 30


def test_multinode_script_runs_with_this_host_as_head(launch, tmp_path):
    env = job_env(
        HEAD="127.0.0.1",
        PORT=str(free_port()),
        RUN_ID="recipe",
        NPROC="2",
        MAX_NODES="1",
        CHECKPOINT_DIR=str(tmp_path / "ckpt"),
    )
    script = ["bash", os.path.join(REPO_ROOT, "examples", "multinode.sh")]
    job = launch(["--max-steps", "40", "--checkpoint-every-steps", "20"], script=script, env=env)
    assert job.wait(90) == 0, job.log()[-3000:]
    assert final_state(env["CHECKPOINT_DIR"])["progress"]["step"] == 40

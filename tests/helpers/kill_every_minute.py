"""Manual measurement (issue 36): the effective training time of a job that loses a training
process every minute, with --replace-in-place and with torchrun's restart, side by side.

    python -m tests.helpers.kill_every_minute --minutes 10 --every 60

Both jobs run at once (2 ranks each, the toy task, a checkpoint every 100 steps), so they share
the machine's load; every ``--every`` seconds each loses the training process of a random rank
(SIGKILL). After ``--minutes`` both are stopped with SIGTERM (a preemption: the step is
committed) and each one's goodput is read from its event log (``elastictrain.observe.goodput``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import tempfile
import time

from elastictrain.observe.events import Event, read_events
from elastictrain.observe.goodput import goodput
from elastictrain.observe.timeline import build_timeline
from tests.helpers.launcher import Job, job_env


def _start(workdir: str, in_place: bool) -> tuple[Job, str]:
    name = "in-place" if in_place else "restart"
    ev = os.path.join(workdir, f"{name}.jsonl")
    args = ["--checkpoint-dir", os.path.join(workdir, name), "--event-log", ev]
    args += ["--max-steps", "100000000", "--checkpoint-every-steps", "100"]
    args += ["--task-option", "step_time=0.02", "--log-every-seconds", "5"]
    args += ["--replace-in-place", "--max-replacements", "100"] if in_place else []
    torchrun = ["--standalone", "--nproc_per_node=2", "--max-restarts=100"]
    return Job(torchrun, args, os.path.join(workdir, f"{name}.log"), workdir, job_env()), ev


def _kill(job: Job, ev: str, in_place: bool, rank: int) -> None:
    if in_place:
        starts = [e for e in read_events(ev) if e["event"] == Event.START]
        os.kill(starts[-1]["processes"][rank][1], signal.SIGKILL)
    else:
        job.kill_worker(rank)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--every", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as workdir:
        jobs = {mode: _start(workdir, mode) for mode in (True, False)}
        t_end = time.monotonic() + 60 * args.minutes
        next_kill = time.monotonic() + args.every
        try:
            while time.monotonic() < t_end:
                time.sleep(max(0.0, min(next_kill, t_end) - time.monotonic()))
                if time.monotonic() >= next_kill and time.monotonic() < t_end:
                    rank = rng.randrange(2)
                    for mode, (job, ev) in jobs.items():
                        _kill(job, ev, mode, rank)
                    next_kill += args.every
            for job, _ in jobs.values():
                job.proc.send_signal(signal.SIGTERM)  # torchrun forwards it: a preemption
            for job, _ in jobs.values():
                job.wait(120)
        finally:
            for job, _ in jobs.values():
                if job.proc.poll() is None:
                    job.kill()
        out = {}
        for mode, (_, ev) in jobs.items():
            g = goodput(build_timeline(read_events(ev)))
            out["in-place" if mode else "restart"] = g.fields()
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

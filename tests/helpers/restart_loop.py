"""Kill -> restart cycles under plain ``torchrun --standalone``; every restart must resume.

Used by the test suite, and runnable for the full measurement:

    python -m tests.helpers.restart_loop --cycles 30            # elastictrain's init
    python -m tests.helpers.restart_loop --cycles 30 --plain    # torch's env:// init (hazard)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

from elastictrain.observe.events import Event
from tests.helpers.launcher import Job, events_so_far, job_env


def count_events(path: str, name: str) -> list[dict[str, Any]]:
    return [e for e in events_so_far(path) if e["event"] == name]


def wait_for_count(path: str, name: str, n: int, timeout: float, job: Job) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = count_events(path, name)
        if len(events) >= n:
            return events[n - 1]
        if job.proc.poll() is not None:
            raise AssertionError(
                f"torchrun exited ({job.proc.returncode}) waiting for {name} #{n}:\n{job.log()[-3000:]}"
            )
        time.sleep(0.05)
    raise AssertionError(
        f"{name} #{n} not seen within {timeout}s: a restart hung.\n{job.log()[-3000:]}"
    )


def run_cycles(
    workdir: str,
    cycles: int,
    *,
    nproc: int = 2,
    seed: int = 0,
    plain: bool = False,
    cycle_timeout: float = 90.0,
    init_timeout: float = 30.0,
) -> dict[str, Any]:
    """Kill a random worker ``cycles`` times; return per-restart figures."""
    rng = random.Random(seed)
    events = os.path.join(workdir, "events.jsonl")
    env = job_env(**({"ELASTICTRAIN_DIAGNOSTIC_ENV_INIT": "1"} if plain else {}))
    job = Job(
        [
            "--standalone",
            f"--nproc_per_node={nproc}",
            f"--max-restarts={cycles * 3 if plain else cycles}",
        ],
        [
            "--checkpoint-dir",
            os.path.join(workdir, "ckpt"),
            "--event-log",
            events,
            "--max-steps",
            "1000000",
            "--checkpoint-every-steps",
            "50",
            "--init-timeout",
            str(init_timeout),
            "--task-option",
            "step_time=0.005",
        ],
        os.path.join(workdir, "torchrun.log"),
        cwd=workdir,
        env=env,
    )
    restarts = []
    try:
        for k in range(cycles):
            wait_for_count(events, Event.RESUME, k + 1, cycle_timeout, job)
            time.sleep(rng.uniform(0.0, 0.5))
            t_kill = time.time()
            job.kill_worker(rng.randrange(nproc))
            resumed = wait_for_count(events, Event.RESUME, k + 2, cycle_timeout, job)
            start = count_events(events, Event.START)[k + 1]
            restarts.append(
                {
                    "cycle": k + 1,
                    "kill_to_resume_s": round(resumed["time"] - t_kill, 3),
                    "init_s": start["init_s"],
                    "restart_count": start["restart_count"],
                }
            )
    finally:
        job.kill()
    counts = [r["restart_count"] for r in restarts]
    failed_attempts = counts[-1] - len(counts) if counts else 0
    durations = [r["kill_to_resume_s"] for r in restarts]
    return {
        "cycles": cycles,
        "resumed": len(restarts),
        "failed_attempts": failed_attempts,
        "kill_to_resume_s": {
            "min": min(durations),
            "median": statistics.median(durations),
            "max": max(durations),
        }
        if durations
        else None,
        "max_init_s": max(r["init_s"] for r in restarts) if restarts else None,
        "restarts": restarts,
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cycles", type=int, default=30)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--plain", action="store_true", help="use torch's env:// init to show the hazard"
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        try:
            result = run_cycles(d, args.cycles, nproc=args.nproc, seed=args.seed, plain=args.plain)
        except AssertionError as e:
            print(f"FAILED: {e}", file=sys.stderr)
            return 1
    summary = {k: v for k, v in result.items() if k != "restarts"}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

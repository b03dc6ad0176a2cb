"""Manual measurement (issue 36): what being ready for an in-place recovery costs while nothing
fails: the step time with --replace-in-place beside without it, and the memory each spare holds.

    python -m tests.helpers.inplace_cost [--steps 1500] [--repeats 3] [--hidden 1024]

Runs the toy job (2 ranks, ``--task-option hidden=H``) alternately without and with the flag,
``--repeats`` times each, and compares the median steady-state seconds a step (the ``end``
event's ``after_first_step_s`` over the steps after the first). While the in-place job trains,
each spare's resident memory (VmRSS) is read from /proc.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from elastictrain.observe.events import Event, read_events
from elastictrain.tools.chaos import descendants
from tests.helpers.launcher import Job, _environ, job_env


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _run(workdir: str, steps: int, hidden: int, in_place: bool, n: int) -> tuple[float, list]:
    ev = os.path.join(workdir, f"ev-{n}.jsonl")
    args = ["--checkpoint-dir", os.path.join(workdir, f"c{n}"), "--event-log", ev]
    args += [
        "--max-steps",
        str(steps),
        "--checkpoint-every-steps",
        "0",
        "--log-every-seconds",
        "60",
    ]
    args += ["--task-option", f"hidden={hidden}", "--task-option", "batch_size=32"]
    args += ["--replace-in-place"] if in_place else []
    log = os.path.join(workdir, f"{n}.log")
    job = Job(["--standalone", "--nproc_per_node=2"], args, log, workdir, job_env())
    spares: list[float] = []
    while job.proc.poll() is None:
        time.sleep(0.5)
        for pid in descendants(job.proc.pid):
            if _environ(pid).get("ELASTICTRAIN_ROLE") == "spare":
                spares.append(_rss_mb(pid))
    assert job.wait(10) == 0, job.log()[-2000:]
    (end,) = [e for e in read_events(ev) if e["event"] == Event.END]
    return end["after_first_step_s"] / (steps - 1), spares


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden", type=int, default=1024)
    args = p.parse_args()
    plain, ready, spare_mb = [], [], []
    with tempfile.TemporaryDirectory() as workdir:
        for i in range(args.repeats):
            plain.append(_run(workdir, args.steps, args.hidden, False, 2 * i)[0])
            step_s, spares = _run(workdir, args.steps, args.hidden, True, 2 * i + 1)
            ready.append(step_s)
            spare_mb += spares
    out = {
        "step_s_without": statistics.median(plain),
        "step_s_with_replace_in_place": statistics.median(ready),
        "ratio": statistics.median(ready) / statistics.median(plain),
        "spare_rss_mb_max": max(spare_mb, default=0.0),
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Manual (issue 27, docs/faults.md): the no-false-positive matrix at full scale. Each case runs the
toy task on 2 workers with the default detection flags (--silent-timeout 15, --hang-floor 60,
--hang-timeout 600) and must finish in one attempt: no exit, no restart. The cases run at once
(they mostly sleep); the suite runs the 10 s pause on two nodes (tests/integration/test_liveness.py).

    python -m tests.helpers.false_positives            # every case, about 8 minutes
    python -m tests.helpers.false_positives slow-rank  # one
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import threading
import time

from elastictrain.observe.events import Event, read_events
from tests.helpers.launcher import Job, job_env, wait_for_event

THROTTLED = ("--task", "elastictrain.bench.throttled_fs:make_task")


def _options(**kw: object) -> list[str]:
    return [a for k, v in kw.items() for a in ("--task-option", f"{k}={v}")]


CASES: dict[str, dict] = {
    # One rank 5x slower than the other: the other waits in every all-reduce.
    "slow-rank": dict(app=_options(step_time=0.05, slow_rank=1, slow_factor=5), steps=400),
    # A first step of 3 minutes on every rank (a compilation).
    "first-step-3min": dict(app=_options(step_time=0.01, first_step_time=180), steps=200),
    # A resume whose load takes about 3 minutes: the checkpoint behind a 40 KB/s link.
    "slow-load-3min": dict(
        app=[*THROTTLED, *_options(step_time=0.01, hidden=512, layers=4)],
        steps=60,
        seed_steps=20,
        env={"ET_THROTTLE_BPS": "40000"},
        throttled=True,
    ),
    # Storage that stops answering for 90 s (the 60 s, and past the 60 s --hang-floor), 25 s
    # after the launch, while rank 0 persists every 20 steps (1 s): the persist in flight stalls,
    # the next checkpoint waits for it at its gate, and rank 1 waits for rank 0 in the next step.
    "storage-stall-90s": dict(
        app=[*THROTTLED, *_options(step_time=0.05), "--checkpoint-every-steps", "20"],
        steps=1000,
        stall=(25, 90),
        throttled=True,
    ),
    # A worker stopped for 10 s (SIGSTOP, then SIGCONT: a swap storm, a long GC).
    "paused-10s": dict(app=_options(step_time=0.02), steps=1500, pause_s=10),
}


def run_case(name: str, case: dict, tmp: str, results: dict) -> None:
    home = os.path.join(tmp, name)
    os.makedirs(home)
    ckpt, ev = os.path.join(home, "ckpt"), os.path.join(home, "ev.jsonl")
    url = f"throttled://{ckpt}" if case.get("throttled") else ckpt
    torchrun = ["--standalone", "--nproc_per_node=2", "--max-restarts=2"]
    base = ["--checkpoint-dir", url, "--event-log", ev, "--log-every-seconds", "5",
            "--no-local-checkpoint"]  # fmt: skip
    t0 = time.monotonic()
    if case.get("seed_steps"):  # a checkpoint to resume, written at full speed
        seed = Job(torchrun, [*base[:1], ckpt, *base[2:], "--max-steps", str(case["seed_steps"]),
                              *case["app"]], os.path.join(home, "seed.log"), home, job_env())  # fmt: skip
        if seed.wait(300) != 0:
            results[name] = f"FAILED to write the checkpoint to resume: {seed.log()[-500:]}"
            return
        os.remove(ev)
    env = dict(case.get("env", {}))
    if case.get("stall"):
        after, seconds = case["stall"]
        env["ET_THROTTLE_STALL_FROM"] = str(time.time() + after)
        env["ET_THROTTLE_STALL_UNTIL"] = str(time.time() + after + seconds)
    job = Job(torchrun, [*base, "--max-steps", str(case["steps"]), *case["app"]],
              os.path.join(home, "job.log"), home, job_env(**env))  # fmt: skip
    if case.get("pause_s"):
        wait_for_event(ev, lambda e: e["event"] == Event.PROGRESS and e["step"] >= 100, 120, job)
        pid = job.workers()[1]
        os.kill(pid, signal.SIGSTOP)
        time.sleep(case["pause_s"])
        os.kill(pid, signal.SIGCONT)
    code = job.wait(1500)
    events = read_events(ev)
    starts = sum(e["event"] == Event.START for e in events)  # rank 0's, one per attempt
    exits = [f"rank {e['rank']} {e['cause']}" for e in events if e["event"] == Event.EXIT]
    waits = [e.get("waited_s", 0) for e in events if e["event"] == Event.CHECKPOINT]
    ok = code == 0 and starts == 1 and not exits
    results[name] = (f"{'ok' if ok else 'FALSE POSITIVE'}: exit {code}, {starts} attempt(s), "
                     f"exits {exits or 'none'}, the longest wait for a persist "
                     f"{max(waits, default=0):.0f}s, {time.monotonic() - t0:.0f}s")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help=f"some of {', '.join(CASES)} (default: all)")
    names = parser.parse_args().cases or list(CASES)
    unknown = set(names) - set(CASES)
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}; known: {', '.join(CASES)}")
    results: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        threads = [
            threading.Thread(target=run_case, args=(n, CASES[n], tmp, results)) for n in names
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for name in names:
        print(f"{name:18s} {results.get(name, 'no result (the case raised)')}")


if __name__ == "__main__":
    main()

"""``bench scale --processes W,W,...``: the whole runner with W real torchrun workers on this host.

Each W launches the toy task (``--parallel ddp`` or ``fsdp``) as one ``torchrun --standalone`` node
of W workers, and measures what grows with W when every rank is a real process: start-up (launch to
the first step), the checkpoints (rank 0's persist seconds, median of the first three), and a
SIGKILL of one worker until the restarted group's first step. On a 2-core machine the processes
share two cores, so the figures are upper bounds on what each rank costs, read side by side.
"""

from __future__ import annotations

import os
import signal
import statistics
import tempfile
import time
from typing import Any

from elastictrain.bench.child import Torchrun, child_env, events_in, first_step_after, wait_for
from elastictrain.observe.events import Event


def measure(world: int, parallel: str, workdir: str) -> dict[str, Any]:
    ckpt, ev = os.path.join(workdir, f"ckpt-{world}"), os.path.join(workdir, f"ev-{world}.jsonl")
    args = [
        "-m",
        "elastictrain",
        "--checkpoint-dir",
        ckpt,
        "--event-log",
        ev,
        "--max-steps",
        "1000000",
        "--checkpoint-every-steps",
        "10",
        "--parallel",
        parallel,
        "--no-local-checkpoint",
        "--log-every-seconds",
        "5",
        "--init-timeout",
        "600",
        "--task-option",
        "step_time=0",
    ]
    t_launch = time.time()
    job = Torchrun(args, os.path.join(workdir, f"job-{world}.log"), child_env(), nproc=world)
    try:
        first = wait_for(
            lambda: [e for e in events_in(ev) if e["event"] == Event.FIRST_STEP],
            600,
            "the first step",
            job,
        )[0]

        def three_saves() -> list[dict[str, Any]] | None:
            saves = [e for e in events_in(ev) if e["event"] == Event.CHECKPOINT]
            return saves[:3] if len(saves) >= 3 else None

        saves = wait_for(three_saves, 600, "three checkpoints", job)
        t_kill = time.time()
        os.kill(job.workers()[world - 1], signal.SIGKILL)
        again = first_step_after(ev, t_kill, 600, "the first step after the kill", job)
        resumed = [e for e in events_in(ev) if e["event"] == Event.RESUME and e["time"] > t_kill]
    finally:
        job.stop()
    smaller = _resume_smaller(args, ev, world, workdir) if parallel == "fsdp" else {}
    return {
        "world": world,
        "parallel": parallel,
        "startup_s": first["time"] - t_launch,
        "persist_s": statistics.median(e["persist_s"] for e in saves),
        "blocked_s": statistics.median(e["blocked_s"] for e in saves),
        "kill_to_first_step_s": again["time"] - t_kill,
        "resumed_step": resumed[0]["step"] if resumed else None,
        **smaller,
    }


def _resume_smaller(args: list[str], ev: str, world: int, workdir: str) -> dict[str, Any]:
    """The same checkpoints resumed by 3W/4 workers: the sharded state resharded on load."""
    new_world = max(1, world * 3 // 4)
    t_launch = time.time()
    job = Torchrun(
        args, os.path.join(workdir, f"job-{world}-to-{new_world}.log"), child_env(), nproc=new_world
    )
    try:
        first = first_step_after(ev, t_launch, 600, f"the first step at {new_world} workers", job)
        resume = [e for e in events_in(ev) if e["event"] == Event.RESUME and e["time"] > t_launch]
    finally:
        job.stop()
    return {
        "resumed_at": new_world,
        "resume_launch_to_first_step_s": first["time"] - t_launch,
        "resume_load_s": first.get("resume_s"),
        "resumed_step_at_new_world": resume[0]["step"] if resume else None,
    }


def run(worlds: list[int], parallel: str) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as workdir:
        return [measure(w, parallel, workdir) for w in worlds]


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        f"| W | {rows[0]['parallel']} start-up to first step | persist (median) | blocked | "
        "kill -> first step | resumed at |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['world']} | {r['startup_s']:.1f} s | {r['persist_s']:.3f} s | "
            f"{r['blocked_s']:.4f} s | {r['kill_to_first_step_s']:.1f} s | "
            f"{r['resumed_step']} |"
        )
    for r in rows:
        if "resumed_at" in r:
            out.append(
                f"W = {r['world']} -> {r['resumed_at']}: launch to first step "
                f"{r['resume_launch_to_first_step_s']:.1f} s (load {r['resume_load_s']} s), "
                f"resumed at step {r['resumed_step_at_new_world']}"
            )
    return "\n".join(out)


def main(worlds: list[int], parallel: str, as_json: bool) -> int:
    import json

    rows = run(worlds, parallel)
    print(json.dumps(rows) if as_json else table(rows))
    return 0

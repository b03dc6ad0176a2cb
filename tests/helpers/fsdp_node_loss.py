"""Manual measurement: an FSDP job of 2 simulated nodes × 2 ranks loses node 1 (agent and workers,
SIGKILL) and goes on at 2 ranks: with the fast tier, with the durable tier alone, and with nothing
to resume from, one after the other. Prints what each resume read and from where, steps redone,
kill -> first step, and the step time before the kill (the fast tier's cost, against durable).

    python -m tests.helpers.fsdp_node_loss [--kill-at 150]

Both nodes run through examples/two_nodes.sh (NPROC=2), each with its own tier folder, fast copies
at ``auto`` and durable ones every 100, ~4 MB of sharded state (toy task, hidden=512, layers=3).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time

from elastictrain.observe.events import Event, read_events, read_sample_log
from tests.helpers.launcher import TWO_NODES, node_env
from tests.helpers.net import free_port

ARGS = ["--parallel", "fsdp", "--max-steps", "400", "--checkpoint-every-steps", "100",
        "--task-option", "step_time=0.05", "--log-every-seconds", "1",
        "--task-option", "hidden=512", "--task-option", "layers=3"]  # fmt: skip


def wait(events_file: str, found, what: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hits = (
            [e for e in read_events(events_file) if found(e)] if os.path.exists(events_file) else []
        )
        if hits:
            return hits[0]
        time.sleep(0.3)
    raise TimeoutError(what)


MODES = {
    "fast": ["--local-every-steps", "auto"],
    "durable": ["--no-local-checkpoint"],
    "empty": ["--no-local-checkpoint", "--checkpoint-every-steps", "1000000"],
}
"""The fast tier on; the durable tier alone; nothing to resume from (the floor of a restart)."""


def measure(root: str, mode: str, kill_at: int) -> dict:
    ev, samples, ckpt = f"{root}/ev.jsonl", f"{root}/samples", f"{root}/ckpt"
    port, nodes = free_port(), []
    for node in (0, 1):
        os.makedirs(f"{root}/host{node}")
        args = [*ARGS, "--event-log", ev, "--sample-log", samples, *MODES[mode],
                "--local-checkpoint-dir", f"{root}/host{node}/shm"]  # fmt: skip
        env = node_env(node, port, f"fsdp-node-loss-{mode}", ckpt, NPROC="2")
        log = open(f"{root}/node{node}.log", "w")  # noqa: SIM115 - lives as long as the node
        nodes.append(subprocess.Popen([*TWO_NODES, *args], env=env, cwd=f"{root}/host{node}",
                                      stdout=log, stderr=log, start_new_session=True))  # fmt: skip
    try:
        wait(ev, lambda e: e["event"] == Event.PROGRESS and e.get("world_size") == 4
             and e["step"] >= kill_at, f"step {kill_at} at 4 ranks")  # fmt: skip
        t_kill = time.time()
        before = read_events(ev)
        rates = [e["steps_per_s"] for e in before if e["event"] == Event.PROGRESS]
        copies = [e["step"] for e in before if e["event"] == Event.LOCAL_CHECKPOINT]
        os.killpg(nodes[1].pid, signal.SIGKILL)
        first = wait(ev, lambda e: e["event"] == Event.FIRST_STEP and e["time"] > t_kill, "restart")
        resume = wait(ev, lambda e: e["event"] == Event.RESUME and e["time"] > t_kill, "resume")
    finally:
        for proc in nodes:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    rows = read_sample_log(samples)
    oldest = min(e["generation"] for e in rows)
    trained = max(e["step"] + 1 for e in rows if e["generation"] == oldest)
    step_dirs = sorted(glob.glob(f"{ckpt}/step-*"))
    shards = (
        sum(os.path.getsize(f) for f in glob.glob(f"{step_dirs[-1]}/shard-*")) if step_dirs else 0
    )
    moved = resume.get("local_bytes", 0) + resume.get("peer_bytes", 0)
    return {
        "resumed": {k: resume.get(k) for k in ("step", "tier", "world_size", "saved_world_size",
                                                "local_bytes", "peer_bytes", "remote_bytes")},
        "steps_redone": trained - resume["step"],
        "fast_copy_interval": copies[-1] - copies[-2] if len(copies) > 1 else None,
        "kill_to_first_step_s": round(first["time"] - t_kill, 2),
        "moved_over_new_shards": round(moved / shards, 4) if shards and moved else None,
        # Progress lines before the kill, the first left out (it holds the start).
        "step_s_before_kill": round(1 / statistics.median(rates[1:]), 4) if rates[1:] else None,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill-at", type=int, default=150)
    kill_at = parser.parse_args().kill_at
    result = {}
    for mode in MODES:
        root = tempfile.mkdtemp(prefix=f"fsdp-node-loss-{mode}-")
        try:
            result[mode] = measure(root, mode, kill_at)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    fast, durable, empty = result["fast"], result["durable"], result["empty"]
    result["fast_restart_over_empty"] = round(
        fast["kill_to_first_step_s"] / empty["kill_to_first_step_s"], 3
    )
    result["fast_step_overhead"] = round(
        fast["step_s_before_kill"] / durable["step_s_before_kill"] - 1, 4
    )
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

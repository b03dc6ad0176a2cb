"""Manual measurement: an FSDP job of 2 simulated nodes × 2 ranks loses node 1 (agent and workers,
SIGKILL) and goes on at 2 ranks from the fast tier. Prints what the resume read and from where.

    python -m tests.helpers.fsdp_node_loss [--kill-at 150]

Both nodes run through examples/two_nodes.sh (NPROC=2), each with its own tier folder, fast copies
every 5 steps and durable ones every 100, ~4 MB of sharded state (toy task, hidden=512, layers=3).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

from elastictrain.observe.events import Event, read_events, read_sample_log
from tests.helpers.launcher import TWO_NODES, node_env
from tests.helpers.net import free_port

ARGS = ["--parallel", "fsdp", "--max-steps", "400", "--checkpoint-every-steps", "100",
        "--local-every-steps", "5", "--task-option", "step_time=0.05", "--log-every-seconds", "1",
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill-at", type=int, default=150)
    kill_at = parser.parse_args().kill_at
    root = tempfile.mkdtemp(prefix="fsdp-node-loss-")
    ev, samples, ckpt = f"{root}/ev.jsonl", f"{root}/samples", f"{root}/ckpt"
    port, nodes = free_port(), []
    for node in (0, 1):
        os.makedirs(f"{root}/host{node}")
        args = [*ARGS, "--event-log", ev, "--sample-log", samples,
                "--local-checkpoint-dir", f"{root}/host{node}/shm"]  # fmt: skip
        env = node_env(node, port, "fsdp-node-loss", ckpt, NPROC="2")
        log = open(f"{root}/node{node}.log", "w")  # noqa: SIM115 - lives as long as the node
        nodes.append(subprocess.Popen([*TWO_NODES, *args], env=env, cwd=f"{root}/host{node}",
                                      stdout=log, stderr=log, start_new_session=True))  # fmt: skip
    try:
        wait(ev, lambda e: e["event"] == Event.PROGRESS and e.get("world_size") == 4
             and e["step"] >= kill_at, f"step {kill_at} at 4 ranks")  # fmt: skip
        t_kill = time.time()
        os.killpg(nodes[1].pid, signal.SIGKILL)
        first = wait(ev, lambda e: e["event"] == Event.FIRST_STEP and e["time"] > t_kill, "restart")
        resume = wait(ev, lambda e: e["event"] == Event.RESUME and e["time"] > t_kill, "resume")
        nodes[0].wait(300)
    finally:
        for proc in nodes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    rows = read_sample_log(samples)
    oldest = min(e["generation"] for e in rows)
    trained = max(e["step"] + 1 for e in rows if e["generation"] == oldest)
    step_dir = sorted(glob.glob(f"{ckpt}/step-*"))[-1]
    shards = sum(os.path.getsize(f) for f in glob.glob(f"{step_dir}/shard-*"))
    moved = resume.get("local_bytes", 0) + resume.get("peer_bytes", 0)
    print(json.dumps({
        "resumed": {k: resume.get(k) for k in ("step", "tier", "world_size", "saved_world_size",
                                                "local_bytes", "peer_bytes", "remote_bytes")},
        "steps_redone": trained - resume["step"],
        "kill_to_first_step_s": round(first["time"] - t_kill, 2),
        "moved_over_new_shards": round(moved / shards, 4),
    }, indent=1))  # fmt: skip
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

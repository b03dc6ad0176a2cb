"""Manual (docs/faults.md): freeze one simulated node of the two-node recipe for good (its agent and
workers SIGSTOPped: sockets open, as a hung host's) and time the other node back to training.

    python -m tests.helpers.freeze_host 1   # a node without the rendezvous store
    python -m tests.helpers.freeze_host 0   # the node whose agent hosts the rendezvous store
    python -m tests.helpers.freeze_host rank0 --rdzv-off-node   # rank 0's node; the rendezvous
                                                                # store on a host of its own

Prints the survivor's last words and the seconds from the freeze to its first step alone, or that
it did not train again within ``--wait`` seconds.

    python -m tests.helpers.freeze_host store   # a TCPStore get, 3 s timeout, server SIGSTOPped
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from elastictrain.observe.events import Event, read_events
from tests.helpers.launcher import TWO_NODES as SCRIPT
from tests.helpers.launcher import Job, node_env, wait_for_event
from tests.helpers.net import free_port


def frozen_store_get(wait: float) -> None:
    """Why liveness never waits on a store call: time one ``get`` against a frozen server."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    port = free_port()
    serve = ("import sys, time, torch.distributed as d; s = d.TCPStore('127.0.0.1', int(sys.argv[1]), "
             "is_master=True, wait_for_workers=False); time.sleep(1e9)")  # fmt: skip
    server = subprocess.Popen([sys.executable, "-c", serve, str(port)])
    try:
        client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
        client.set("k", "v")
        client.set_timeout(timedelta(seconds=3))
        os.kill(server.pid, signal.SIGSTOP)
        outcome: list[str] = []
        t0 = time.monotonic()

        def get() -> None:
            try:
                client.get("k")
                outcome.append(f"returned after {time.monotonic() - t0:.1f}s")
            except Exception as e:
                outcome.append(f"{type(e).__name__} after {time.monotonic() - t0:.1f}s")

        threading.Thread(target=get, daemon=True).start()
        deadline = t0 + wait
        while not outcome and time.monotonic() < deadline:
            time.sleep(0.1)
        print(
            f"get with a 3 s timeout, server frozen: {outcome[0] if outcome else f'still blocked after {wait:.0f}s'}"
        )
    finally:
        server.kill()
        server.wait()
    sys.stdout.flush()
    os._exit(0)  # the get's thread is still inside torch: a normal exit would abort on it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "node",
        choices=("0", "1", "rank0", "store"),
        help="the node to freeze: 0 (hosts the rendezvous unless --rdzv-off-node), "
        "1, or rank0 (whichever holds rank 0 and the workers' store)",
    )
    parser.add_argument("--wait", type=float, default=180.0)
    parser.add_argument(
        "--rdzv-off-node",
        action="store_true",
        help="the rendezvous store in a process of its own, not in node 0's agent",
    )
    args = parser.parse_args()
    if args.node == "store":
        frozen_store_get(args.wait)
        return
    with tempfile.TemporaryDirectory() as tmp:
        port, run_id = free_port(), f"freeze-{uuid.uuid4().hex[:6]}"
        ev = os.path.join(tmp, "ev.jsonl")
        app = ["--max-steps", "100000", "--checkpoint-every-steps", "40", "--event-log", ev]
        app += ["--log-every-seconds", "0.5", "--task-option", "step_time=0.02"]
        nodes, extra = [], {}
        if args.rdzv_off_node:  # a store server alone, as on a small CPU host next to the job
            serve = ("import sys, time, torch.distributed as d; "
                     "s = d.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, "
                     "wait_for_workers=False); time.sleep(1e9)")  # fmt: skip
            nodes.append(subprocess.Popen([sys.executable, "-c", serve, str(port)]))
            extra = {"RDZV_OFF_NODE": "1"}
        for node in (0, 1):
            home = os.path.join(tmp, f"host{node}")
            os.mkdir(home)
            env = node_env(node, port, run_id, os.path.join(tmp, "shared"), **extra)
            nodes.append(Job.wrapping([*SCRIPT, *app], os.path.join(home, "log"), home, env))
        store_server = nodes.pop(0) if args.rdzv_off_node else None
        try:
            wait_for_event(ev, lambda e: e["event"] == Event.PROGRESS and e["step"] >= 60, 150)
            frozen = int(args.node) if args.node != "rank0" else int(0 not in nodes[0].workers())
            t_freeze = time.time()
            nodes[frozen].signal_node(signal.SIGSTOP)
            survivor = nodes[1 - frozen]
            try:
                alone = wait_for_event(
                    ev,
                    lambda e: e["event"] == Event.FIRST_STEP and e["time"] > t_freeze,
                    args.wait,
                    survivor,
                )
                print(f"froze node {frozen}: training again {alone['time'] - t_freeze:.1f}s later")
            except AssertionError as e:
                print(f"froze node {frozen}: not training again: {str(e).splitlines()[0]}")
            for e in read_events(ev):
                if e["event"] == Event.EXIT and e["time"] > t_freeze:
                    print(f"  rank {e['rank']} exit: {e['cause']}: {e['detail']}")
            print("  survivor's log tail:\n" + survivor.log()[-1500:])
        finally:
            for job in nodes:
                job.kill()
            if store_server is not None:
                store_server.kill()
                store_server.wait()


if __name__ == "__main__":
    main()

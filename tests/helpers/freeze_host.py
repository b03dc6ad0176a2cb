"""Manual (docs/faults.md): freeze one simulated node for good (its agent and workers SIGSTOPped:
sockets open, as a hung host's) and time the survivors back to training.

    python -m tests.helpers.freeze_host rank0 --nodes 3 --runs 3   # the node holding rank 0
    python -m tests.helpers.freeze_host other --nodes 2 --runs 3   # a node without rank 0
    python -m tests.helpers.freeze_host rank0 --per-round-stores   # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    python -m tests.helpers.freeze_host rank0 --kill    # SIGKILL the node instead: a lost node
    python -m tests.helpers.freeze_host rdzv-host   # the two-node recipe's node 0, which hosts
                                                    # torchrun's rendezvous store
    python -m tests.helpers.freeze_host store       # a TCPStore get, 3 s timeout, server frozen

``rank0``/``other`` run ``--nodes`` agents of one rank each, torch's defaults (torchrun shares its
agent's store with the workers) unless ``--per-round-stores``, with the rendezvous store in a
process of its own, off the nodes (docs/multinode.md). Each run prints the seconds from the freeze
to the survivors' first step, and the survivors' first words.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta

from elastictrain.observe.events import Event, read_events
from tests.helpers.launcher import TWO_NODES as SCRIPT
from tests.helpers.launcher import Job, job_env, node_env, off_node_agent, store_server
from tests.helpers.net import free_port

APP = ["--max-steps", "100000", "--checkpoint-every-steps", "40", "--log-every-seconds", "0.5"]
APP += ["--task-option", "step_time=0.02"]


def frozen_store_get(wait: float) -> None:
    """Why liveness never waits on a store call: time one ``get`` against a frozen server."""
    import torch.distributed as dist

    port = free_port()
    with store_server(port) as server:
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
        blocked = f"still blocked after {wait:.0f}s"
        print(f"get with a 3 s timeout, server frozen: {outcome[0] if outcome else blocked}")
    sys.stdout.flush()
    os._exit(0)  # the get's thread is still inside torch: a normal exit would abort on it


def freeze_one(what: str, nodes: int, per_round: bool, wait: float, kill: bool) -> float | None:
    """One job of ``nodes`` nodes; freeze one (``kill``: SIGKILL it and everything under it, a
    lost node); seconds to the survivors' first step, or None."""
    with tempfile.TemporaryDirectory() as tmp:
        port, run_id = free_port(), f"freeze-{uuid.uuid4().hex[:6]}"
        ev, shared = os.path.join(tmp, "ev.jsonl"), os.path.join(tmp, "shared")
        app = [*APP, "--event-log", ev]
        jobs: list[Job] = []
        env = job_env()
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        if per_round:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        with store_server(port) if what != "rdzv-host" else contextlib.nullcontext():
            try:
                for node in range(nodes):
                    home = os.path.join(tmp, f"host{node}")
                    os.mkdir(home)
                    log = os.path.join(home, "log")
                    if what == "rdzv-host":  # the recipe: node 0's agent hosts the rendezvous
                        recipe = node_env(node, port, run_id, shared)
                        jobs.append(Job.wrapping([*SCRIPT, *app], log, home, recipe))
                        continue
                    tier = ["--checkpoint-dir", shared, "--local-checkpoint-dir", f"{home}/tier"]
                    targs = off_node_agent(f"1:{nodes}", port, run_id)
                    jobs.append(Job(targs, [*tier, *app], log, home, env))
                wait_for(ev, lambda e: e["event"] == Event.START and e["world_size"] == nodes, 150)
                time.sleep(3)  # a few steps at full size
                holder = next(i for i, j in enumerate(jobs) if 0 in j.workers())
                frozen = {"rank0": holder, "other": (holder + 1) % nodes, "rdzv-host": 0}[what]
                t_freeze = time.time()
                if kill:
                    jobs[frozen].kill()
                else:
                    jobs[frozen].signal_node(signal.SIGSTOP)
                again = wait_for(
                    ev, lambda e: e["event"] == Event.FIRST_STEP and e["time"] > t_freeze, wait
                )
                exits = [e for e in read_events(ev) if e["event"] == Event.EXIT]
                words = [e["detail"][:110] for e in exits if e["time"] > t_freeze] or ["-"]
                took = again["time"] - t_freeze if again else None
                said = f"{took:.1f}s" if took is not None else f"not within {wait:.0f}s"
                print(
                    f"  {'killed' if kill else 'froze'} node {frozen} ({what}, rank 0 on node "
                    f"{holder}): training again "
                    f"{said}; first words: {words[0]}"
                )
                return took
            finally:
                for job in jobs:
                    job.kill()


def wait_for(path: str, predicate, timeout: float) -> dict | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in read_events(path) if predicate(e)] if os.path.exists(path) else []
        if found:
            return found[0]
        time.sleep(0.1)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("rank0", "other", "rdzv-host", "store"))
    parser.add_argument("--nodes", type=int, default=3, help="agents of one rank each")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument(
        "--per-round-stores",
        action="store_true",
        help="export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 to every agent",
    )
    parser.add_argument("--wait", type=float, default=120.0)
    parser.add_argument("--kill", action="store_true", help="SIGKILL the node instead (lost)")
    args = parser.parse_args()
    if args.what == "store":
        frozen_store_get(args.wait)
        return
    nodes = 2 if args.what == "rdzv-host" else args.nodes
    stores = "per-round stores" if args.per_round_stores else "torch defaults (shared store)"
    if args.what == "rdzv-host":
        stores = "the two-node recipe (per-round stores, node 0 hosts the rendezvous)"
    print(f"{nodes} nodes, {'kill' if args.kill else 'freeze'} {args.what}, {stores}:")
    times = [
        freeze_one(args.what, nodes, args.per_round_stores, args.wait, args.kill)
        for _ in range(args.runs)
    ]
    done = [t for t in times if t is not None]
    if done:
        print(f"median {statistics.median(done):.1f}s over {len(done)} of {len(times)} runs")


if __name__ == "__main__":
    main()

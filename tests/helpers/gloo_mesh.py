"""Manual (docs/scale.md): what a gloo group costs in connections, eager against lazy
(``TORCH_GLOO_LAZY_INIT=1``), and how fast each tells the survivors that a peer died before the
group's first collective. W spawned processes, gloo on one TCPStore, a group like the runner's
control group (``new_group(backend="gloo")``), then the gates it carries: barrier, an all-reduce and
a broadcast from rank 0.

    python -m tests.helpers.gloo_mesh 32            # connections per process, eager and lazy
    python -m tests.helpers.gloo_mesh 4 --peer-dies # the last rank exits before the first gate
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.net import free_port

GROUP_TIMEOUT_S = 10


def established_tcp(pid: int) -> int:
    """ESTABLISHED TCP sockets the process holds (its fds matched against /proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            lines = f.read().splitlines()[1:]
        for line in lines:
            cols = line.split()
            count += cols[9] in inodes and cols[3] == "01"
    return count


def _worker(rank: int, world: int, port: int, peer_dies: bool, out) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    # The default group on its own prefix, so the count below is the control group's alone.
    dist.init_process_group("gloo", store=dist.PrefixStore("default", store), rank=rank,
                            world_size=world)  # fmt: skip
    before = established_tcp(os.getpid())
    t0 = time.perf_counter()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    made_s = time.perf_counter() - t0
    at_init = established_tcp(os.getpid()) - before
    if peer_dies and rank == world - 1:
        os._exit(0)
    if peer_dies:
        time.sleep(1)  # the peer is gone before anyone's first gate
    t0 = time.perf_counter()
    try:
        dist.barrier(group=group)
        x = torch.ones(1)
        dist.all_reduce(x, group=group)
        dist.broadcast(x, 0, group=group)
        outcome = "ok"
    except RuntimeError as e:
        outcome = f"error: {str(e).splitlines()[0][-90:]}"
    gates_s = time.perf_counter() - t0
    after_gates = established_tcp(os.getpid()) - before
    out.put((rank, made_s, at_init, after_gates, gates_s, outcome))
    if not peer_dies:
        dist.barrier()  # nobody closes a connection before everyone has counted
    out.close()
    out.join_thread()
    os._exit(0)


def run(world: int, peer_dies: bool) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, peer_dies, out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    rows = []
    try:
        for _ in range(world - peer_dies):
            rows.append(out.get(timeout=10 * GROUP_TIMEOUT_S))
    finally:
        for p in procs:
            p.join(timeout=30)  # the final barrier: killing sooner breaks a peer's count
            p.kill()
            p.join()
    mode = "lazy" if os.environ.get("TORCH_GLOO_LAZY_INIT") == "1" else "eager"
    rows.sort()
    print(
        f"{mode}, W = {world}{', the last rank died before the first gate' if peer_dies else ''}:"
    )
    for rank, _made_s, _at_init, _after_gates, gates_s, outcome in rows:
        if peer_dies:
            print(f"  rank {rank}: gates {gates_s:.2f}s -> {outcome}")
    if not peer_dies:
        print(f"  new_group: max {max(r[1] for r in rows):.3f}s; connections per process at init: "
              f"max {max(r[2] for r in rows)}, after the gates: max {max(r[3] for r in rows)} "
              f"(rank 0: {rows[0][3]}), mean {sum(r[3] for r in rows) / len(rows):.1f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("world", type=int)
    parser.add_argument("--peer-dies", action="store_true")
    parser.add_argument("--mode", choices=("both", "eager", "lazy"), default="both")
    args = parser.parse_args()
    if args.mode != "both":
        run(args.world, args.peer_dies)
        return
    for mode in ("eager", "lazy"):  # a fresh interpreter each: gloo reads the variable once
        env = {**os.environ, "TORCH_GLOO_LAZY_INIT": "1" if mode == "lazy" else "0"}
        cmd = [sys.executable, "-m", "tests.helpers.gloo_mesh", str(args.world), "--mode", mode]
        subprocess.run(cmd + (["--peer-dies"] if args.peer_dies else []), env=env, check=True)


if __name__ == "__main__":
    main()

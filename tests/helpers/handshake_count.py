"""Count the TCPStore requests of elastictrain's handshake at W ranks: W threads, each with its own
client of one real TCPStore (docs/scale.md). Threads, not processes, so W can be 64 on 2 cores;
the request counts are the protocol's, the timings only this harness's.

    python -m tests.helpers.handshake_count 64
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from elastictrain.dist import handshake
from elastictrain.env import DistEnv


class Counting:
    def __init__(self, store, counts, lock):
        self.s, self.c, self.l = store, counts, lock

    def __getattr__(self, name):
        fn = getattr(self.s, name)

        def wrapped(*a, **k):
            with self.l:
                self.c[name] += 1
            return fn(*a, **k)

        return wrapped


W = int(sys.argv[1])
server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
port = server.port
counts, lock = collections.Counter(), threading.Lock()
# round-trip latency on loopback
c = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60))
t0 = time.perf_counter()
for i in range(2000):
    c.set(f"k{i}", b"v")
rt = (time.perf_counter() - t0) / 2000


def run(rank):
    env = DistEnv(
        rank=rank,
        world_size=W,
        local_rank=0,
        local_world_size=1,
        master_addr="127.0.0.1",
        master_port=port,
        restart_count=0,
        max_restarts=0,
        run_id="x",
        use_agent_store=True,
        launched_by_torchrun=True,
    )
    st = Counting(
        dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60)), counts, lock
    )
    handshake(st, env, 60)


t0 = time.perf_counter()
ts = [threading.Thread(target=run, args=(r,)) for r in range(W)]
for t in ts:
    t.start()
for t in ts:
    t.join()
print(
    f"W={W}: {sum(counts.values())} store requests {dict(counts)} in {time.perf_counter() - t0:.2f}s; set round trip {rt * 1e6:.0f} us"
)

"""Count the TCPStore requests of elastictrain's handshake at W ranks: W threads, each with its own
client of one real TCPStore (docs/scale.md). Threads, not processes, so W can be 64 on 2 cores;
the request counts are the protocol's, the timings only this harness's.

    python -m tests.helpers.handshake_count 64
"""

from __future__ import annotations

import argparse
import collections
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from elastictrain.dist import handshake
from elastictrain.env import DistEnv


class Counting:
    """A store client that counts each request by method."""

    def __init__(self, store, counts: collections.Counter, lock: threading.Lock) -> None:
        self.store, self.counts, self.lock = store, counts, lock

    def __getattr__(self, name):
        fn = getattr(self.store, name)

        def counted(*args, **kwargs):
            with self.lock:
                self.counts[name] += 1
            return fn(*args, **kwargs)

        return counted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("world_size", type=int)
    world = p.parse_args().world_size
    timeout = timedelta(seconds=60)
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, None, False, timeout)
    t0 = time.perf_counter()
    for i in range(2000):  # the round trip of one request on loopback
        client.set(f"k{i}", b"v")
    round_trip = (time.perf_counter() - t0) / 2000
    counts, lock = collections.Counter(), threading.Lock()

    def rank(r: int) -> None:
        env = DistEnv(
            rank=r,
            world_size=world,
            local_rank=0,
            local_world_size=1,
            master_addr="127.0.0.1",
            master_port=server.port,
            restart_count=0,
            max_restarts=0,
            run_id="count",
            use_agent_store=True,
            launched_by_torchrun=True,
        )
        store = dist.TCPStore("127.0.0.1", server.port, None, False, timeout)
        handshake(Counting(store, counts, lock), env, 60)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(
        f"W={world}: {sum(counts.values())} store requests {dict(counts)} in "
        f"{time.perf_counter() - t0:.2f}s; set round trip {round_trip * 1e6:.0f} us"
    )


if __name__ == "__main__":
    main()

"""One rank of a 2-rank gloo group on the test's TCPStore, for ``tests/unit/test_epoch_end.py``.

Rank BLOCKED (0 by default) watches its epoch (``epoch_end.EpochEnd.watch``, with the epoch's
connection ledger) and enters an all-reduce; the other rank stays alive with its connections open
and never joins it, as a peer wedged behind a dead one does (on NCCL, every survivor of a death).
Gloo's rank 1 connects to rank 0's listener, so BLOCKED 1 waits on a connection it opened, BLOCKED
0 on one it accepted. The blocked rank also holds two TCP connections of its own (a user's: one
opened before the epoch, one while it trains, each to a listener of its own). It prints, as one
JSON line, how long its all-reduce took to fail, whether the error reads as a peer's loss, and
whether its own connections still carry bytes.

    python -m tests.helpers.epoch_watch_probe RANK STORE_PORT NONCE [BLOCKED]
"""

from __future__ import annotations

import json
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elastictrain.cluster.connections import EpochConnections
from elastictrain.inplace import epoch_end, members


def _user_connection() -> tuple[socket.socket, socket.socket]:
    """A connection of the user's (a metrics logger's, an upload's): both of its ends."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    return client, accepted


def _carries(ends: tuple[socket.socket, socket.socket]) -> bool:
    try:
        ends[0].sendall(b"x")
        return ends[1].recv(1) == b"x"
    except OSError:
        return False


def main() -> None:
    rank, port, nonce = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    blocked = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
    before = _user_connection()
    connections = EpochConnections()
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"{nonce}/pg/", store),
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=120),
    )
    connections.learn(dist.group.WORLD)
    if rank != blocked:
        print("ready", flush=True)
        time.sleep(120)  # alive, connections open, never in the collective
        return
    during = _user_connection()
    end = epoch_end.EpochEnd(nonce, port, connections, member=rank).watch(store)
    print("ready", flush=True)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        out = {"raised": False}
    except Exception as e:
        out = {"raised": True, "after_s": time.monotonic() - t0}
        out["peer_loss"] = members.is_peer_loss(e, end)
        out["silent"] = end.silent
    out["own_connections_carry"] = [_carries(before), _carries(during)]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

"""A manual measurement: how often a TCPStore request waits ~5 s after a bare connection to the
store (connected and closed unused, as ``job_store``'s wait for the store's host does).

    python -m tests.helpers.store_stall [--tries 300] [--reset]

The server runs in a process of its own, as torchrun's agent holds it. ``--reset`` closes each
bare connection with a reset (SO_LINGER 0) instead of the usual FIN. docs/faults.md cites it
(2026-12-05, torch 2.13, this VM: 6 requests of 300 waited 5 s; with ``--reset``, 0, 5 and 2
of 300 in three runs: a reset is no cure).
"""

from __future__ import annotations

import argparse
import socket
import struct
import time
from datetime import timedelta

import torch.distributed as dist

from tests.helpers.launcher import store_server
from tests.helpers.net import free_port


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tries", type=int, default=300)
    p.add_argument("--reset", action="store_true", help="close each bare connection with a reset")
    args = p.parse_args()
    port = free_port()
    with store_server(port):
        client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
        waits = []
        for _ in range(args.tries):
            with socket.create_connection(("127.0.0.1", port), timeout=5.0) as bare:
                if args.reset:
                    bare.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            t0 = time.monotonic()
            client.add("requests", 1)
            waits.append(time.monotonic() - t0)
    slow = [w for w in waits if w > 1.0]
    print(
        f"{len(slow)} of {args.tries} requests waited over 1 s after a bare connection "
        f"({'reset' if args.reset else 'FIN'}); longest {max(waits):.2f} s"
    )


if __name__ == "__main__":
    main()

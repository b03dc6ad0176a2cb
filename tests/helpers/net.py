"""Free loopback ports for the servers and rendezvous the tests start."""

from __future__ import annotations

import random
import socket

# Not the global generator: a test that seeds it would make two workers draw the same ports.
_random = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback port nothing listens on, drawn from below the ephemeral range.

    Why not ``bind(0)``: that port comes from the range every outgoing connection draws its local
    port from, so between our check and the server's bind, any of the suite's many connections can
    take it. A CI run lost a rendezvous store that way: both agents timed out connecting for 60 s.
    """
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    for _ in range(100):
        port = _random.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {low}-{high}")

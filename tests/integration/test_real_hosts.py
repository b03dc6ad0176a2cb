"""The real-hosts harness (``tests/helpers/real_hosts.py``) makes hosts, and its faults do what
a network does: each node its own hostname, name resolution, /dev/shm and address; a cut link
keeps the far side's processes alive and its connections open; a heal, a pairwise cut, a slow
link, a power-off; nothing left behind. Skipped where namespaces cannot be made (not root)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.helpers.real_hosts import RealHosts, unavailable

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")
PORT = 29511

SERVER = f"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", {PORT}))
s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept()
    n = 0
    while True:
        b = c.recv(65536)
        if not b or b.endswith(b"!"):
            n += len(b)
            break
        n += len(b)
    c.sendall(str(n).encode())
    c.close()
"""


def _send(hosts: RealHosts, frm: int, to: int, nbytes: int, timeout: float) -> tuple[bool, float]:
    """Whether ``nbytes`` went from node ``frm`` to node ``to``'s server within ``timeout``, and
    the seconds it took."""
    client = (
        "import socket, sys, time\n"
        f"c = socket.create_connection(({hosts.addr(to)!r}, {PORT}), timeout={timeout})\n"
        f"c.sendall(b'x' * {nbytes - 1} + b'!')\n"
        "print(c.recv(64).decode())\n"
    )
    t0 = time.monotonic()
    done = hosts.run(frm, [sys.executable, "-c", client], timeout=timeout + 30)
    return done.returncode == 0 and done.stdout.strip() == str(nbytes), time.monotonic() - t0


def test_real_hosts_are_hosts_and_their_faults_are_a_network_s():
    with RealHosts(3) as hosts:
        tag, root = hosts.tag, hosts.root
        # Each node its own name, resolving to its address on the bridge, in every node.
        assert hosts.run(0, ["hostname"]).stdout.strip() == "node0"
        resolve = "import socket; print(socket.gethostbyname('node1'), socket.gethostname())"
        assert hosts.run(2, [sys.executable, "-c", resolve]).stdout.split() == [
            hosts.addr(1),
            "node2",
        ]
        # Each node its own memory: a file in node 0's /dev/shm is in no other's, nor here.
        assert hosts.run(0, ["sh", "-c", f"echo 1 > /dev/shm/{tag}"]).returncode == 0
        assert hosts.run(0, ["cat", f"/dev/shm/{tag}"]).stdout == "1\n"
        assert hosts.run(1, ["test", "-e", f"/dev/shm/{tag}"]).returncode != 0
        assert not os.path.exists(f"/dev/shm/{tag}")

        server = hosts.popen(1, [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "listening"
        assert _send(hosts, 0, 1, 1000, 5)[0]
        # A cut: node 1 unreachable, its server alive; healed, reachable again.
        hosts.cut(1)
        assert not _send(hosts, 0, 1, 1000, 1.5)[0]
        assert server.poll() is None
        hosts.heal(1)
        assert _send(hosts, 0, 1, 1000, 5)[0]
        # A pairwise cut: node 0 cannot reach node 1, node 2 still can.
        hosts.cut_between(0, 1)
        assert not _send(hosts, 0, 1, 1000, 1.5)[0]
        assert _send(hosts, 2, 1, 1000, 5)[0]
        hosts.join_between(0, 1)
        assert _send(hosts, 0, 1, 1000, 5)[0]
        # A slow link: 400 KB through 2 Mbit/s takes 1.6 s or more.
        fast = _send(hosts, 0, 1, 400_000, 10)
        hosts.slow(1, "2mbit")
        slow = _send(hosts, 0, 1, 400_000, 20)
        assert fast[0] and slow[0]
        assert slow[1] >= 1.5 > fast[1], (fast, slow)
        # A power-off: every process of the node gone, and its memory.
        assert hosts.run(1, ["sh", "-c", f"echo 1 > /dev/shm/{tag}"]).returncode == 0
        killed = hosts.power_off(1)
        assert server.pid in killed or server.wait(5) is not None
        assert server.wait(5) == -9
        assert hosts.run(1, ["test", "-e", f"/dev/shm/{tag}"]).returncode != 0
    # Nothing left: no namespace of this test, no process in one, no folder.
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert tag not in names
    assert not os.path.exists(root)

"""Nodes that are real hosts on this machine: each its own network namespace with an address on a
bridge, its own hostname (a UTS namespace) and ``/etc/hosts`` naming every node, its own
``/dev/shm`` (a tmpfs of its own, bound over ``/dev/shm`` in each of its processes' mount
namespaces) and, on request, its own node-local folder. And the faults a network makes, each a
call: a link cut and healed, a blip, a one-way or pairwise cut, a slow link, a power-off.

    with RealHosts(2) as hosts:
        agent = hosts.popen(0, ["torchrun", ...], stdout=log)
        hosts.cut(1)        # node 1's link down: its processes live on, their sockets stay open
        hosts.heal(1)
        hosts.power_off(1)  # the link cut first, then every process of the node SIGKILLed

The bridge lives in a namespace of its own; the root namespace only creates each veth pair with
its ends already in the node's and the bridge's namespaces. Names and the subnet come from a
random tag, so the suite's parallel workers never collide; teardown kills every process in the
test's namespaces, removes them and the node memories, also after a failure. Every address is
inside namespaces this object made: nothing leaves the machine.

Needs root and ``ip`` (iproute2); :func:`unavailable` says why not, for a test's skip. Gloo is
told each node's interface (``GLOO_SOCKET_IFNAME=eth0``, in :meth:`env`) and torchrun its
address (``--local-addr``, :meth:`addr`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence

IFACE = "eth0"
"""Every node's interface on the bridge (GLOO_SOCKET_IFNAME)."""
_ENTER = (
    'hostname "$ET_HOSTNAME" && mount --bind "$ET_SHM" /dev/shm && '
    'mount --bind "$ET_HOSTS" /etc/hosts && exec "$@"'
)
"""Run in a node, inside ``ip netns exec``'s own mount namespace and a new UTS namespace."""


def unavailable() -> str | None:
    """Why real hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "real hosts need root (network namespaces); CI runs as root"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "real hosts need iproute2's ip and util-linux's unshare (.ci/run installs them)"
    probe = f"etp-{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"network namespaces are not available here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
    return done.stdout


class RealHosts:
    """``n`` nodes named ``node0``..., at ``10.<a>.<b>.1``...; a context manager."""

    def __init__(self, n: int, *, node_local: bool = False) -> None:
        tag = uuid.uuid4().hex[:6]
        self.tag = f"et{tag}"
        self.n = n
        subnet = int(tag[:4], 16)
        self.prefix = f"10.{100 + subnet % 100}.{subnet // 100 % 256}"
        self.bridge = f"{self.tag}-br"
        self.names = [f"node{i}" for i in range(n)]
        self.netns = [f"{self.tag}-n{i}" for i in range(n)]
        self.root = tempfile.mkdtemp(prefix=f"{self.tag}-")
        self.shm = [os.path.join(self.root, f"shm{i}") for i in range(n)]
        self.local = [os.path.join(self.root, f"local{i}") for i in range(n)] if node_local else []
        self._hosts = os.path.join(self.root, "hosts")
        self._procs: list[subprocess.Popen] = []

    def addr(self, i: int) -> str:
        return f"{self.prefix}.{i + 1}"

    # -- making and removing -----------------------------------------------------------------
    def __enter__(self) -> RealHosts:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        _ip("netns", "add", self.bridge)
        _ip("link", "add", "br0", "type", "bridge", netns=self.bridge)
        _ip("link", "set", "br0", "up", netns=self.bridge)
        with open(self._hosts, "w") as f:
            f.write("127.0.0.1 localhost\n")
            f.writelines(f"{self.addr(i)} {name}\n" for i, name in enumerate(self.names))
        for i, ns in enumerate(self.netns):
            _ip("netns", "add", ns)
            # Both ends are born in their namespaces: the root namespace keeps nothing.
            _ip(
                *("link", "add", "name", IFACE, "netns", ns, "type", "veth"),
                *("peer", "name", f"v{i}", "netns", self.bridge),
            )
            _ip("link", "set", f"v{i}", "master", "br0", netns=self.bridge)
            _ip("link", "set", f"v{i}", "up", netns=self.bridge)
            _ip("addr", "add", f"{self.addr(i)}/24", "dev", IFACE, netns=ns)
            _ip("link", "set", IFACE, "up", netns=ns)
            _ip("link", "set", "lo", "up", netns=ns)
            os.makedirs(self.shm[i])
            self._mount_memory(i)
        for folder in self.local:
            os.makedirs(folder)

    def _mount_memory(self, i: int) -> None:
        """A node's memory: a tmpfs of its own, gone when it powers off."""
        size = ["-o", "size=256m"]
        subprocess.run(["mount", "-t", "tmpfs", *size, "tmpfs", self.shm[i]], check=True)

    def close(self) -> None:
        """Every process in the test's namespaces killed, the namespaces and node memories
        removed. Safe to call twice, and after a failed start."""
        for ns in [*self.netns, self.bridge]:
            for pid in self.pids(ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        for ns in [*self.netns, self.bridge]:
            _ip("netns", "del", ns, check=False)
        for shm in self.shm:
            subprocess.run(["umount", "-l", shm], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)

    @staticmethod
    def pids(netns: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    # -- running things on a node --------------------------------------------------------------
    def env(self, i: int, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment a process on node ``i`` starts with: gloo on the bridge's interface."""
        return {**(base if base is not None else os.environ), "GLOO_SOCKET_IFNAME": IFACE}

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run on node ``i``: its network, hostname, /etc/hosts and /dev/shm."""
        inner = ["unshare", "--uts", "sh", "-c", _ENTER, "sh", *argv]
        return ["ip", "netns", "exec", self.netns[i], *inner]

    def popen(self, i: int, argv: Sequence[str], *, env=None, **kw) -> subprocess.Popen:
        """Start ``argv`` on node ``i`` in a session of its own (killed at teardown)."""
        env = {
            **self.env(i, env),
            "ET_HOSTNAME": self.names[i],
            "ET_SHM": self.shm[i],
            "ET_HOSTS": self._hosts,
        }
        proc = subprocess.Popen(self.command(i, argv), env=env, start_new_session=True, **kw)
        self._procs.append(proc)
        return proc

    def run(
        self, i: int, argv: Sequence[str], timeout: float = 30, **kw
    ) -> subprocess.CompletedProcess:
        proc = self.popen(i, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    # -- faults --------------------------------------------------------------------------------
    def cut(self, i: int) -> None:
        """Node ``i``'s link down at the bridge: a partition. Its processes live on and their
        connections stay open; nothing on either side is told."""
        _ip("link", "set", f"v{i}", "down", netns=self.bridge)

    def heal(self, i: int) -> None:
        _ip("link", "set", f"v{i}", "up", netns=self.bridge)

    def blip(self, i: int, seconds: float) -> threading.Thread:
        """The link down for ``seconds``, then up again, in the background (a flapping port)."""

        def down_then_up() -> None:
            self.cut(i)
            time.sleep(seconds)
            self.heal(i)

        thread = threading.Thread(target=down_then_up, daemon=True)
        thread.start()
        return thread

    def cut_between(self, i: int, j: int, *, both_ways: bool = True) -> None:
        """Node ``i`` cannot reach node ``j`` (and, ``both_ways``, ``j`` not ``i``); each still
        reaches every other node: blackhole routes, no extra package."""
        _ip("route", "add", "blackhole", f"{self.addr(j)}/32", netns=self.netns[i])
        if both_ways:
            _ip("route", "add", "blackhole", f"{self.addr(i)}/32", netns=self.netns[j])

    def join_between(self, i: int, j: int) -> None:
        for a, b in ((i, j), (j, i)):
            _ip("route", "del", "blackhole", f"{self.addr(b)}/32", netns=self.netns[a], check=False)

    def slow(self, i: int, rate: str) -> None:
        """Node ``i``'s link at ``rate`` (tc's token bucket, e.g. ``"8mbit"``) both ways: its
        egress on its interface, its ingress on the bridge's end of its link."""
        tbf = ["tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"]
        for ns, dev in ((self.netns[i], IFACE), (self.bridge, f"v{i}")):
            qdisc = ["tc", "qdisc", "replace", "dev", dev, "root", *tbf]
            subprocess.run(["ip", "netns", "exec", ns, *qdisc], check=True, capture_output=True)

    def power_off(self, i: int) -> list[int]:
        """A crash: the link cut first (so no reset reaches anyone), then every process of the
        node SIGKILLed, and its memory (``/dev/shm``) gone. The pids killed."""
        self.cut(i)
        killed = self.pids(self.netns[i])
        for pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        subprocess.run(["umount", "-l", self.shm[i]], capture_output=True)
        self._mount_memory(i)  # empty, for the node's next boot
        return killed

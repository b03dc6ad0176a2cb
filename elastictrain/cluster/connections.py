"""Which TCP connections are a membership epoch's, and how to shut them (the one way to fail a gloo
collective blocked on a frozen peer: gloo cannot abort one).

A leaf of group setup (``dist.init_process_groups`` records the ledger as it builds the groups);
``inplace.epoch_end`` shuts what the ledger names when the epoch ends.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat

import torch.distributed as dist


def break_collectives(keep_port: int, connections: EpochConnections | None = None) -> int:
    """Shut down the epoch's TCP connections (``connections``: none without them), never those
    to the job's store (port ``keep_port``); the number shut.

    Why: a frozen peer (SIGSTOP, a wedged host) keeps its sockets open, so a gloo collective
    waiting on it blocks until --collective-timeout, and gloo cannot abort one. Shutting the
    connections from under it fails the collective at once, as a dead peer's reset does, so this
    rank leaves the epoch with its state and the survivors regroup without the silent rank. The
    epoch's groups are being given up anyway; the store is kept, since the next epoch is agreed
    through it.
    """
    shut = 0
    if connections is None:  # groups not built here (a diagnostic init): nothing is known ours
        return shut
    for sock in _tcp_sockets():
        with sock:
            try:
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue  # a listener: no collective waits on it
                local, peer = _endpoint(sock.getsockname()), _endpoint(sock.getpeername())
                if keep_port in (peer[1], local[1]) or not connections.owns(local, peer):
                    continue
                sock.shutdown(socket.SHUT_RDWR)  # the connection itself, for every fd of it
                shut += 1
            except (OSError, IndexError, TypeError):  # not connected: nothing waits on it
                continue
    return shut


class EpochConnections:
    """Which TCP connections are the epoch's: those of its gloo groups, found by their listeners.

    Every gloo group listens on a port of its own and each pair of ranks connects once, one end
    to the other's listener (``ProcessGroupGloo``'s full mesh). So a connection is the epoch's
    when one of its ends is a listener the epoch's groups opened, on any member: each member
    records its own as its groups are built (the listeners that appeared since
    :meth:`__init__`) and all of them learn everyone's (:meth:`learn`). Nothing else is touched:
    a user's socket, an S3 upload in flight (a background persist), a metrics logger's
    connection to its local service, a listener opened once training runs, or the job's store.
    """

    def __init__(self) -> None:
        """Before the epoch's first group is built."""
        self._before = _listeners()
        self._known: set[tuple[str, int]] = set()
        self._anywhere: set[int] = set()

    def learn(self, group: dist.ProcessGroup) -> None:
        """Every member, collectively, each time the epoch has built groups (its first groups;
        then the mesh, tiers and sessions, before training): every member's listeners, so that
        a connection this rank opened to a frozen member is known as the epoch's too."""
        mine = sorted(_listeners() - self._before)
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        self._known = {(host, port) for listeners in everyone for host, port in listeners}
        # A listener on every interface is seen by the other end at one host's address: its port.
        self._anywhere = {port for host, port in self._known if host in _ANY_HOST}

    def owns(self, local: tuple[str, int], peer: tuple[str, int]) -> bool:
        return bool({local, peer} & self._known) or bool({local[1], peer[1]} & self._anywhere)


def _tcp_sockets():
    """This process's TCP stream sockets (each a dup: closing it leaves the connection alone)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if not stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        tcp = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
        if tcp:
            yield sock  # a loader worker's pipe, a unix socket: never the groups'
        else:
            sock.close()


def _listeners() -> set[tuple[str, int]]:
    found = set()
    for sock in _tcp_sockets():
        with sock, contextlib.suppress(OSError):
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                found.add(_endpoint(sock.getsockname()))
    return found


_ANY_HOST = ("0.0.0.0", "::")


def _endpoint(address) -> tuple[str, int]:
    """(host, port), an IPv4 address mapped into IPv6 written as IPv4: how the other end sees it."""
    host = address[0].removeprefix("::ffff:")
    return host, int(address[1])

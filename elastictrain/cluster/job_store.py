"""The c10d store the workers share, and a bound on every request made of it.

Which store. torchrun (torch 2.13, the default ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0``) hands
each worker ``MASTER_ADDR``/``MASTER_PORT`` of a TCPStore hosted by the agent that was rank 0, and
each agent caches that address from the first round it joined
(``DynamicRendezvousHandler.next_rendezvous``): only a node that becomes rank 0 builds a new one
(the fix of pytorch#182221). So when that node is lost, or frozen with its sockets open, and two
or more nodes survive, the new rank 0's workers get a fresh store and everyone else's the lost
node's: the restarted group waits on it until ``--init-timeout`` (issue 33; docs/faults.md). The
workers therefore share **torchrun's rendezvous store**, the one store every agent must reach to
re-form the group at all, whenever they can name it (``env.rendezvous_store``), under a prefix of
their run id. Otherwise (``--standalone``, the static or etcd backend) they use the store torchrun
hands them, or, with per-round stores, the one rank 0 hosts.

A bound on every request. A TCPStore client whose server is frozen (SIGSTOP, a hung host) ignores
its own timeout: a 3 s ``get`` was still blocked after 60 s (``python -m tests.helpers.freeze_host
store``). So the connection is made on a thread of its own and given ``--silent-timeout`` once
something listens, and from then on liveness asks the store every beat (``Liveness.watch_store``)
while the handshake and process-group init wait on it, so a store that stops answering ends the
rank in seconds, naming the store, instead of at ``--init-timeout``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from elastictrain.cluster.env import DistEnv, StoreAddress, rendezvous_store
from elastictrain.errors import InitTimeoutError, StoreSilentError

logger = logging.getLogger(__name__)

T = TypeVar("T")
_LISTEN_RETRY_S = 0.2  # between tries while nothing listens yet (its host starts later)


class BoundedCalls:
    """Requests of a store, each waited for at most ``seconds``, at most one in flight.

    Each request runs on a daemon thread of its own, so a frozen store costs the asking thread
    only the wait; a request still unanswered is not joined by another (the caller learns it is
    still stuck instead of piling up threads)."""

    def __init__(self, seconds: float, name: str = "elastictrain-store") -> None:
        self.seconds, self._name = seconds, name
        self._pending: threading.Event | None = None
        # The beat thread and a rank's stop (or its verdict) may ask at once: the look at the
        # pending request and the claim of the slot are one step, or both requests would run.
        self._claim = threading.Lock()

    def __call__(self, request: Callable[[], T]) -> T:
        with self._claim:
            if self._pending is not None and not self._pending.is_set():
                raise TimeoutError("the previous request is still unanswered")
            done = self._pending = threading.Event()
        answer: dict[str, Any] = {}

        def call() -> None:
            try:
                answer["value"] = request()
            except BaseException as e:  # handed to the asking thread
                answer["error"] = e
            finally:
                done.set()

        threading.Thread(target=call, name=self._name, daemon=True).start()
        if not done.wait(self.seconds):
            raise TimeoutError(f"no answer within {self.seconds:g}s")
        if "error" in answer:
            raise answer["error"]
        return answer["value"]


@dataclass(frozen=True)
class JobStore:
    store: dist.Store
    name: str
    """Where it is, for messages: "torchrun's rendezvous store at node0:29400"."""


def connect(env: DistEnv, *, timeout_s: float, silent_s: float, store_up: bool = False) -> JobStore:
    """The store this attempt's handshake and process groups use (see the module's doc).

    ``timeout_s``: how long to wait for its host to listen (--init-timeout: nodes start apart).
    ``silent_s``: how long a host that accepts the connection may take to answer it
    (--silent-timeout; 0: as long as ``timeout_s``).
    ``store_up``: the store answered this job moments ago (an in-place epoch): no wait for its
    host to listen. That wait connects a bare socket and closes it unused, and torch 2.13's
    libuv store server can stall every client for 5 s on such a connection (measured: one
    in-place recovery in three at 4 ranks, ``bench recovery --in-place``); a start has to take
    that risk, since the store's host may not be up yet, a recovery need not.

    Raises:
        InitTimeoutError: nothing listened at the store's address within ``timeout_s``.
        StoreSilentError: its host accepted the connection and never answered: it is frozen.
    """
    rendezvous = rendezvous_store(env)
    if rendezvous is not None:
        name = f"torchrun's rendezvous store at {rendezvous}"
        store = _client(rendezvous, name, timeout_s, silent_s, store_up)
        if env.rank == 0:
            logger.info("the workers share %s (named by the agent's command line)", name)
        # Several runs may share one rendezvous endpoint: their keys must never meet.
        return JobStore(dist.PrefixStore(f"elastictrain/run/{env.run_id}", store), name)
    address = StoreAddress(env.master_addr, env.master_port)
    if env.use_agent_store:
        if env.world_size > env.local_world_size and env.rank == 0:
            logger.warning(
                "the workers use torchrun's shared store at %s (MASTER_ADDR:MASTER_PORT): torch "
                "2.13 keeps handing each node the address it first got, so if the node hosting "
                "it is lost while two or more nodes survive, the restart waits on it. Export "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node (docs/faults.md)",
                address,
            )
        name = f"torchrun's shared store at {address}"
        return JobStore(_client(address, name, timeout_s, silent_s, store_up), name)
    if env.world_size == 1 and env.master_port == 0:
        return JobStore(dist.HashStore(), "a store of this process")
    name = f"rank 0's store at {address}"
    if env.rank != 0:
        return JobStore(_client(address, name, timeout_s, silent_s, store_up), name)
    # Not under a sharing agent: rank 0 hosts the store, like init_method="env://". It does not
    # wait for the others here: they connect as clients of no stated world size, which never
    # count themselves in, so a server told to wait for them waited for --init-timeout (every
    # launch of 2 or more ranks without torchrun hung). The handshake gathers the ranks.
    hosted = dist.TCPStore(
        address.host,
        address.port,
        env.world_size,
        True,
        timedelta(seconds=timeout_s),
        wait_for_workers=False,
        multi_tenant=True,
    )
    return JobStore(hosted, name)


def _client(
    address: StoreAddress,
    name: str,
    timeout_s: float,
    silent_s: float,
    store_up: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> dist.TCPStore:
    deadline = clock() + timeout_s
    if not store_up:
        _wait_until_listening(address, name, deadline, timeout_s, clock)
    # Something listens: a live server answers the client's first request in milliseconds.
    bound = silent_s if silent_s > 0 else max(0.001, deadline - clock())
    wait = timedelta(seconds=max(1.0, deadline - clock()))
    try:
        return BoundedCalls(bound)(
            lambda: dist.TCPStore(address.host, address.port, None, False, wait)
        )
    except TimeoutError as e:
        raise StoreSilentError(
            f"{name} accepted the connection but did not answer within {bound:g}s "
            f"(--silent-timeout): the host that serves it is frozen or unreachable. Exiting so "
            "torchrun re-forms the group"
        ) from e


def _wait_until_listening(
    address: StoreAddress, name: str, deadline: float, timeout_s: float, clock: Callable[[], float]
) -> None:
    """Until a TCP connection to the store is accepted: a refused one means its host has not
    started it yet (a node starting minutes after this one), which --init-timeout allows."""
    while True:
        try:
            with socket.create_connection((address.host, address.port), timeout=5.0):
                return
        except OSError as e:
            if clock() + _LISTEN_RETRY_S > deadline:
                raise InitTimeoutError(
                    f"{name} did not accept a connection within --init-timeout "
                    f"({timeout_s:.0f}s): {e}. Check that its host is up and reachable from "
                    "this node, or raise --init-timeout if nodes start far apart."
                ) from e
            time.sleep(_LISTEN_RETRY_S)

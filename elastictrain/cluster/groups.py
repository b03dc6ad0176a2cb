"""Process-group setup that survives torchrun restarts (the leaf collectives are ``collectives``).

Why a handshake: torchrun shares its rendezvous TCPStore with the workers and keeps it alive across
restarts, but ``init_process_group(init_method="env://")`` then uses that store *without* a
per-attempt prefix (torch/distributed/rendezvous.py: "We create a new TCPStore for every retry so
no need to add prefix", which is false for the shared store). A restarted worker can read the dead
workers' gloo addresses and fail with "connectFullMesh ... Connection refused" or hang in init.

Fix: ranks agree on a fresh attempt nonce (``handshake.py``), and the process group is then built
on ``PrefixStore("elastictrain/<nonce>/", store)``, where no key of an earlier attempt can exist.
Which store that is, and the bound on a store that stops answering, is ``job_store.py``'s.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from elastictrain import knobs
from elastictrain.cluster.agents import StartWatch
from elastictrain.cluster.connections import EpochConnections
from elastictrain.cluster.env import DistEnv, rendezvous_store
from elastictrain.cluster.handshake import Attempt, handshake
from elastictrain.cluster.job_store import connect
from elastictrain.cluster.liveness import Liveness
from elastictrain.errors import EXIT_INIT_TIMEOUT

logger = logging.getLogger(__name__)


def pick_device(env: DistEnv, model_devices: Sequence[torch.device] | None = None) -> torch.device:
    """This rank's device: the first of a model-parallel task's devices, else ``cuda:LOCAL_RANK``
    when CUDA is present, else the CPU."""
    if model_devices:
        if model_devices[0].type == "cuda":
            torch.cuda.set_device(model_devices[0])
        return model_devices[0]
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


class _InitWatchdog:
    """Hard bound on init: whatever gloo/nccl do internally, exit non-zero after the timeout."""

    def __init__(self, timeout: float, rank: int, flag: str) -> None:
        self._timer = threading.Timer(timeout, self._fire, args=(timeout, rank, flag))
        self._timer.daemon = True

    @staticmethod
    def _fire(timeout: float, rank: int, flag: str) -> None:
        logger.error(
            "process-group init did not finish within %s=%.0fs on rank %d; exiting so "
            "torchrun can restart the group",
            flag,
            timeout,
            rank,
        )
        logging.shutdown()
        os._exit(EXIT_INIT_TIMEOUT)

    def __enter__(self) -> _InitWatchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()


@dataclass
class ProcessGroups:
    attempt: Attempt
    control: dist.ProcessGroup
    """gloo group with --checkpoint-timeout for resume/save gates (CPU tensors even on GPU jobs)."""
    store: dist.Store | None = None
    """The job's store (torchrun's), unprefixed: what outlives an attempt (``membership``)."""
    connections: EpochConnections | None = None
    """Which TCP connections are this epoch's (``connections``): all that its end may shut."""


def init_process_groups(
    env: DistEnv,
    device: torch.device,
    *,
    init_timeout: float,
    collective_timeout: float,
    checkpoint_timeout: float,
    liveness: Liveness,
    timeout_flag: str = "--init-timeout",
    store_up: bool = False,
) -> ProcessGroups:
    """``timeout_flag``: what sets ``init_timeout``, named when it runs out. ``store_up``: an
    in-place epoch, whose store answered moments ago (``job_store.connect``). ``liveness`` watches the job's store from the first request on (a frozen store ignores its
    clients' timeouts) and announces this rank's first beat before the group's first barrier, so
    it is there for every rank once init returns."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if knobs.diagnostic_env_init():
        # Diagnostic only: torch's plain env:// init, to measure the restart hazard it has.
        logger.warning(
            "ELASTICTRAIN_DIAGNOSTIC_ENV_INIT=1: using plain env:// init (restart-unsafe)"
        )
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=init_timeout),
            **kwargs,
        )
        control = dist.new_group(backend="gloo", timeout=timedelta(seconds=checkpoint_timeout))
        return ProcessGroups(
            attempt=Attempt(nonce="env", generation=time.time_ns()), control=control
        )
    with _InitWatchdog(init_timeout, env.rank, timeout_flag):
        silent_s = liveness.silent_s if liveness.enabled else 0.0
        job_store = connect(env, timeout_s=init_timeout, silent_s=silent_s, store_up=store_up)
        # After the store (whose listener, on rank 0 without an agent, is not the epoch's).
        connections = EpochConnections()
        # At a start, a node lost before its ranks join is seen in torchrun's round (in place,
        # a node already dropped is not in it either: nothing to watch there).
        watch = None if store_up or rendezvous_store(env) is None else StartWatch(env)
        liveness.watch_store(job_store, watch.lost if watch is not None else None)
        base = job_store.store
        # 90% of the budget, so a missing rank is reported by name before the hard bound fires.
        attempt = handshake(
            base, env, 0.9 * init_timeout, flag_value=init_timeout, flag=timeout_flag
        )
        store = dist.PrefixStore(f"elastictrain/{attempt.nonce}/", base)
        dist.init_process_group(
            backend,
            store=store,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=collective_timeout),
            **kwargs,
        )
        control = dist.new_group(backend="gloo", timeout=timedelta(seconds=checkpoint_timeout))
        liveness.announce(store)
        dist.barrier(group=control)
        connections.learn(control)
    global _built_on_a_fresh_store
    _built_on_a_fresh_store = True
    return ProcessGroups(attempt=attempt, control=control, store=base, connections=connections)


_built_on_a_fresh_store = False


def default_group_is_restart_safe() -> bool:
    """Whether this process's default group was built here (:func:`init_process_groups`: the
    runner, or ``init_distributed``), on a store no earlier attempt wrote to; not by a plain
    ``init_process_group`` on torchrun's shared rendezvous store."""
    return _built_on_a_fresh_store


def shutdown() -> None:
    """Tear down this process's groups (after an NCCL abort there are none left to destroy)."""
    if dist.is_initialized():
        dist.destroy_process_group()

"""The restart-safe handshake: every rank agrees on a fresh attempt, in O(1) store requests each.

Why it exists: torchrun shares its rendezvous TCPStore with the workers and keeps it alive across
restarts, so a restarted worker can read keys a dead attempt left (docs/internals.md). Rank 0 of
each attempt publishes a fresh nonce; the process group is built under ``elastictrain/<nonce>/``,
where no key of an earlier attempt can exist. What the handshake must rule out is a rank trusting
a nonce a dead rank 0 left behind.

The protocol, with every wait a blocking store request (no polling: at W = 8,192 ranks polling
every 20 ms put up to two million requests on one store, docs/scale.md):

- rank 0 reads the previous nonce P, publishes its own N, then points P at N: ``P/next = N`` and
  ``P/outcome = next:N``, which wakes every rank still waiting in P. It waits for ``N/all-joined``
  and sets ``N/outcome = welcome``.
- every other rank waits for a nonce, counts itself in with ``add(N/joined, 1)`` (the rank whose
  add reaches W − 1 sets ``N/all-joined``) and waits for ``N/outcome``: ``welcome``, or ``next:M``
  to start again in M.
- a nonce whose count is already full, or whose world size is not ours, belongs to a finished or
  other attempt: the rank does not join it and waits for its ``next`` instead.

Every wait on another rank is a blocking ``get`` (one request). So a rank makes 4 requests (the
last to join, 5) and rank 0 makes 7, whatever W is and however long rank 0 takes.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from elastictrain.cluster.env import DistEnv
from elastictrain.errors import InitTimeoutError

ATTEMPT_KEY = "elastictrain/attempt"
_WELCOME, _NEXT = "welcome", "next:"


@dataclass(frozen=True)
class Attempt:
    """One start of the worker group, agreed by every rank."""

    nonce: str
    generation: int
    """Rank 0's start time in ns: increases across attempts; stored in every checkpoint."""


def handshake(
    store: dist.Store,
    env: DistEnv,
    timeout: float,
    flag_value: float | None = None,
    flag: str = "--init-timeout",
) -> Attempt:
    """Agree on a fresh attempt nonce; never trusts a value left by an earlier attempt.

    ``flag_value`` is the ``flag`` (--init-timeout, or --replace-timeout for an in-place epoch) to
    name in errors when ``timeout`` is a share of it.
    """
    shown = f"{flag} ({flag_value if flag_value is not None else timeout:.0f}s)"
    deadline = time.monotonic() + timeout
    if env.rank == 0:
        return _lead(store, env, deadline, shown)
    original = store.timeout  # a blocking get waits this long; restored for the process group
    try:
        return _join(store, env, deadline, shown)
    finally:
        store.set_timeout(original)


def _left(deadline: float) -> timedelta:
    return timedelta(seconds=max(0.001, deadline - time.monotonic()))


def _lead(store: dist.Store, env: DistEnv, deadline: float, shown: str) -> Attempt:
    generation = time.time_ns()
    nonce = f"{generation}-{uuid.uuid4().hex[:12]}-{env.world_size}"
    previous = store.get(ATTEMPT_KEY).decode() if store.check([ATTEMPT_KEY]) else None
    store.set(ATTEMPT_KEY, nonce)
    if previous is not None:  # wake whoever still waits in the dead attempt, and send them here
        store.set(f"{previous}/next", nonce)
        store.set(f"{previous}/outcome", _NEXT + nonce)
    if env.world_size > 1:
        try:
            store.wait([f"{nonce}/all-joined"], _left(deadline))
        except dist.DistStoreError as e:
            # The error path alone asks who is missing: W checks, once.
            missing = [
                str(r) for r in range(1, env.world_size) if not store.check([f"{nonce}/join/{r}"])
            ]
            raise InitTimeoutError(
                f"rank 0: ranks {missing} did not join within {shown}. "
                "Raise it if nodes start far apart."
            ) from e
        store.set(f"{nonce}/outcome", _WELCOME)
    return Attempt(nonce=nonce, generation=generation)


def _join(store: dist.Store, env: DistEnv, deadline: float, shown: str) -> Attempt:
    def wait(key: str) -> str:
        """The key's value once it is set: a blocking get is one request (wait + get were two)."""
        store.set_timeout(_left(deadline))  # client-side: no request
        try:
            return store.get(key).decode()
        except dist.DistStoreError as e:
            raise InitTimeoutError(
                f"rank {env.rank}: rank 0 of this attempt did not answer within {shown}. "
                "Raise it if nodes start far apart."
            ) from e

    nonce = wait(ATTEMPT_KEY)
    while True:
        if not nonce.endswith(f"-{env.world_size}"):  # another world size's attempt: not ours
            nonce = wait(f"{nonce}/next")
            continue
        count = store.add(f"{nonce}/joined", 1)
        if count > env.world_size - 1:  # full: a finished attempt whose rank 0 has since died
            nonce = wait(f"{nonce}/next")
            continue
        store.set(f"{nonce}/join/{env.rank}", b"1")  # read only to name who is missing
        if count == env.world_size - 1:
            store.set(f"{nonce}/all-joined", b"1")
        outcome = wait(f"{nonce}/outcome")
        if outcome == _WELCOME:
            return Attempt(nonce=nonce, generation=int(nonce.split("-", 1)[0]))
        nonce = outcome.removeprefix(_NEXT)

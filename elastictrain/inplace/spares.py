"""Hot-spare nodes (``--spare-nodes N``): nodes of the torchrun job that train nothing and take a
lost or evicted node's ranks in place, so the world size and the data split never change.

Which nodes. The last ``N`` of torchrun's nodes by node rank (``GROUP_RANK``) stand by; torchrun
numbers ranks node by node, so theirs are its highest ranks and the training ranks stay
``0 .. T-1`` (:class:`SpareNodes`). A spare's processes import torch, build the task, warm what a
replacement would pay for, then wait in the job's store (:class:`Standby`). They are no
data-parallel rank, join no process group and cost the job nothing per step.

A takeover. When an epoch ends and a whole node of it is not back (lost, frozen, evicted), the
member deciding the next epoch's members (``members.regroup``) calls one spare node per missing
node (:func:`take_over`): each spare rank is told the failed epoch's nonce and the rank it stands
for, answers at once, and is given that rank's place in the next epoch, in the same position of
its rank order. So the next epoch has the same size, the same ranks' data and the same summation
order: a resume at that step, bitwise (its state comes from a survivor, as a replaced process's
does). A spare node that does not answer within the wait (it was lost while it stood by, or it is a
dead process's registration from an earlier torchrun round) is skipped; with none left, the epoch
shrinks as it does without spares.

The keys. Each spare registers a fresh token under its torchrun rank, so a registration a spare of
an earlier round left behind (its process is gone) is never mistaken for a live one: a call to it
is simply never answered. Calls and answers live under the token. At the end rank 0 dismisses the
spares that stand by (:func:`dismiss`), and they exit 0, so their torchrun agents finish too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastictrain.cluster.env import DistEnv
from elastictrain.cluster.job_store import BoundedCalls
from elastictrain.errors import ConfigError, NodeUnhealthyError

logger = logging.getLogger(__name__)

PREFIX = "elastictrain/spares"
POLL_S = 0.5
"""How often a waiting spare looks at its stop signals and its parent."""
_WAIT = timedelta(hours=6)  # one store wait, repeated: a spare may stand by for weeks
_WAKE_S = 5.0  # a spare stopped wakes its own wait; a store that takes longer is gone


@dataclass(frozen=True)
class SpareNodes:
    """Which of torchrun's ranks stand by: the last ``count`` nodes' (``local_world_size`` ranks
    each; torchrun numbers them node by node)."""

    count: int
    world_size: int
    """torchrun's: the training ranks and the spares."""
    local_world_size: int

    @classmethod
    def of(cls, env: DistEnv, wanted: int) -> SpareNodes:
        """``--spare-nodes`` for this torchrun round: at most all nodes but one (a round that
        lost nodes still trains on one), and only where every node has the same ranks."""
        count = min(wanted, max(0, env.group_world_size - 1))
        if wanted and count < wanted and env.rank == 0:
            logger.warning(
                "--spare-nodes %d: torchrun started %d node(s), so %d stand(s) by and %d train",
                wanted,
                env.group_world_size,
                count,
                env.group_world_size - count,
            )
        if count and env.world_size != env.group_world_size * env.local_world_size:
            raise ConfigError(
                f"--spare-nodes {wanted}: a spare node takes a whole node's ranks, so every node "
                f"needs the same --nproc-per-node; this job has {env.world_size} ranks on "
                f"{env.group_world_size} nodes. Give every node the same count."
            )
        return cls(count, env.world_size, env.local_world_size)

    @property
    def training_world_size(self) -> int:
        return self.world_size - self.count * self.local_world_size

    def is_spare(self, rank: int) -> bool:
        return rank >= self.training_world_size

    def nodes(self) -> list[list[int]]:
        """Each spare node's torchrun ranks, in the order they are called."""
        base, n = self.training_world_size, self.local_world_size
        return [list(range(base + i * n, base + (i + 1) * n)) for i in range(self.count)]

    def position(self, rank: int) -> int:
        """Where ``rank`` trains at a start: its own rank; a spare, the same local rank of the
        first training node (it is not one yet: only for checking the task fits before it waits)."""
        return rank if not self.is_spare(rank) else rank % self.local_world_size

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size


@dataclass(frozen=True)
class Call:
    """A spare told to take a rank's place in the epoch after ``nonce``."""

    nonce: str
    stands_for: int
    at: float
    """When the decider called it (wall clock): the takeover's start in the events."""


def _token_key(rank: int) -> str:
    return f"{PREFIX}/{rank}"


def _call_key(token: str) -> str:
    return f"{PREFIX}/{token}/call"


def _answer_key(token: str) -> str:
    return f"{PREFIX}/{token}/answer"


class Standby:
    """A spare rank's side: register, wait to be called, answer."""

    def __init__(
        self, store: dist.Store, rank: int, check: Callable[[], str | None] | None = None
    ) -> None:
        """``check``: this rank's self-check (``cluster.self_check.spare_check``), run before it
        stands by and again when it is called: why it fails, or None."""
        self.store, self.rank, self.check = store, rank, check
        self.token = ""

    def register(self) -> None:
        """A fresh token under this rank: from now on a call reaches this process alone."""
        self.token = uuid.uuid4().hex
        self.store.set(_token_key(self.rank), self.token)

    def wait(self, stop: Callable[[], bool]) -> Call | None:
        """Until called: the call, or None (dismissed: the job finished; or ``stop()``, looked at
        every ``POLL_S``: a stop signal, the agent gone).

        The wait is one blocking store ``wait`` on a thread of its own, over a clone of the store
        (it blocks its connection): a wait that timed out every second to look at ``stop`` would
        print c10d's timeout warning each time. On a stop this process wakes its own wait by
        setting its call key, and joins the thread: no thread of ours may be inside a store
        request while the interpreter finalizes (``epoch_end``'s docstring: SIGABRT)."""
        key = _call_key(self.token)
        called: dict = {}

        def wait() -> None:
            try:
                store = self.store.clone()
                while True:
                    with contextlib.suppress(dist.DistStoreError):  # a timeout: wait again
                        store.wait([key], _WAIT)
                        break
                called.update(json.loads(store.get(key)))
            except Exception as e:  # the store is gone: the job is over, or torchrun restarts
                called["error"] = f"{type(e).__name__}: {e}"

        thread = threading.Thread(target=wait, name="elastictrain-spare-node", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(POLL_S)
            if thread.is_alive() and stop():
                with contextlib.suppress(Exception):
                    BoundedCalls(_WAKE_S, "elastictrain-spare-wake")(
                        lambda: self.store.set(key, json.dumps({"done": "stopped"}))
                    )
                thread.join(_WAKE_S)
                return None
        if "error" in called:
            logger.warning("the spare stops standing by: the job's store is gone (%s)", called)
            return None
        if "done" in called:
            self.store.set(_answer_key(self.token), b"1")
            return None
        call = Call(called["nonce"], int(called["for"]), float(called["at"]))
        # Checked again before it takes the place: it may have stood by for weeks.
        unhealthy = self.check() if self.check is not None else None
        answer = json.dumps({"unhealthy": unhealthy}) if unhealthy else b"1"
        self.store.set(_answer_key(self.token), answer)
        if unhealthy:
            raise self._unhealthy(unhealthy, f"called to take rank {call.stands_for}'s place")
        return call

    def _unhealthy(self, why: str, when: str) -> NodeUnhealthyError:
        return NodeUnhealthyError(
            f"spare node's rank {self.rank}, {when}, failed its self-check: {why}; it leaves "
            "the job (--no-self-check skips the check)"
        )

    def stand_by(
        self, decided: Callable[[str], list[int]], stop: Callable[[], bool]
    ) -> tuple[Call, list[int]] | None:
        """Until a decider gives this rank a lost rank's place: the call and the next epoch's
        members (``decided``: the epoch after a nonce's, once written), or None (dismissed,
        stopped). A call whose epoch went on without it (it answered after the decider gave up
        on its node) leaves it standing by."""
        unhealthy = self.check() if self.check is not None else None
        if unhealthy:
            raise self._unhealthy(unhealthy, "before it stood by")
        while True:
            self.register()
            logger.info(
                "spare node's rank %d ready (pid %d): standing by for a lost node",
                self.rank,
                os.getpid(),
            )
            call = self.wait(stop)
            if call is None:
                return None
            found = decided(call.nonce)
            if self.rank in found:
                return call, found
            logger.warning(
                "rank %d: called to stand in for rank %d, but the epoch went on without this "
                "spare; standing by again",
                self.rank,
                call.stands_for,
            )


def _standing_by(store: dist.Store, ranks: list[int]) -> list[str] | None:
    """The tokens of a spare node's ranks, if every one is registered and none is called yet."""
    if not store.check([_token_key(r) for r in ranks]):
        return None
    tokens = [store.get(_token_key(r)).decode() for r in ranks]
    if any(store.check([_call_key(t)]) for t in tokens):
        return None
    return tokens


def standing_by(store: dist.Store, spares: SpareNodes) -> int:
    """How many spare nodes stand by now (registered, not called): a lost node's possible
    takers. Not whether they are alive: a call finds that out (:func:`take_over`)."""
    return sum(_standing_by(store, node) is not None for node in spares.nodes())


def _answered(store: dist.Store, tokens: list[str], wait_s: float) -> bool:
    with contextlib.suppress(dist.DistStoreError):
        store.wait([_answer_key(t) for t in tokens], timedelta(seconds=wait_s))
        return True
    return False


def _unhealthy(store: dist.Store, tokens: list[str]) -> str | None:
    """A called spare node's self-check failures, from its answers (None: it is healthy)."""
    answers = store.multi_get([_answer_key(t) for t in tokens])
    why = [json.loads(a)["unhealthy"] for a in answers if bytes(a) != b"1"]
    return "; ".join(why) or None


def take_over(
    store: dist.Store,
    spares: SpareNodes,
    nonce: str,
    members: list[int],
    missing: list[int],
    *,
    answer_s: float,
) -> dict[int, int]:
    """The decider of the epoch after ``nonce`` (``members``: its members; ``missing``: those not
    back): one spare node for each node all of whose members are missing, called and answered.
    The lost rank -> the spare rank that takes its place (empty: no spare node answered)."""
    by_node: dict[int, list[int]] = {}
    for m in members:
        by_node.setdefault(spares.node_of(m), []).append(m)
    whole = [ranks for ranks in by_node.values() if all(m in missing for m in ranks)]
    taken: dict[int, int] = {}
    candidates = iter(spares.nodes())
    for lost in whole:
        for node in candidates:
            tokens = _standing_by(store, node)
            if tokens is None or len(node) < len(lost):
                continue
            now = time.time()
            calls = {
                _call_key(t): json.dumps({"nonce": nonce, "for": m, "at": now})
                for t, m in zip(tokens, lost, strict=False)
            }
            store.multi_set(list(calls), list(calls.values()))
            if _answered(store, tokens[: len(lost)], answer_s):
                unhealthy = _unhealthy(store, tokens[: len(lost)])
                if unhealthy:
                    logger.warning(
                        "spare node of ranks %s failed its self-check when called (%s); trying "
                        "the next",
                        node,
                        unhealthy,
                    )
                    continue
                taken.update(zip(lost, node, strict=False))
                logger.warning(
                    "spare node of ranks %s takes the place of the lost ranks %s", node, lost
                )
                break
            logger.warning(
                "spare node of ranks %s did not answer within %.1fs (lost while it stood by); "
                "trying the next",
                node,
                answer_s,
            )
    return taken


def dismiss(store: dist.Store, spares: SpareNodes, *, answer_s: float) -> int:
    """Rank 0, once training is over: every spare that stands by exits 0. The spare nodes that
    answered (alive: their torchrun agents reach the agents' exit barrier themselves)."""
    alive = 0
    waiting: list[list[str]] = []
    for node in spares.nodes():
        tokens = _standing_by(store, node)
        if tokens is None:
            continue
        done = json.dumps({"done": "the job finished"})
        store.multi_set([_call_key(t) for t in tokens], [done] * len(tokens))
        waiting.append(tokens)
    deadline = time.monotonic() + answer_s
    for tokens in waiting:
        alive += _answered(store, tokens, max(0.001, deadline - time.monotonic()))
    return alive


def warm_spare(make_optimizer: Callable[[], Any] | None = None) -> None:
    """A spare, before it waits: pay now what a replacement's first epoch would: DDP's import,
    and the first optimizer's construction (it imports torch._dynamo: most of a start's build
    time). ``make_optimizer``: the task's first optimizer (the runner); else a throwaway one."""
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    if make_optimizer is not None:
        make_optimizer()
    else:
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

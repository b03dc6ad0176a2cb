"""Who is in a membership epoch (``--replace-in-place``): how the ranks that did not fail keep their
processes and their state, and find, with a replacement, the members of the next epoch.

An epoch is one agreed set of training processes. A survivor's loop sees a peer's death as an
error from a collective (gloo's connection to the dead process resets); it keeps what it trained
(:class:`LiveState`: the state of the newest step it completed, as one flat file in memory) and
raises :class:`PeerLost`. The epoch's driver (``driver``) then builds the next epoch in the same
process: its members (:func:`next_members`), the restart-safe handshake on torchrun's store (a
fresh nonce and generation: fresh process groups, and a dead rank 0's background persist is
fenced off), then ``agreement.agree``, then a resume whose bytes come from the survivor holding
the newest step (``checkpoint.resume.live``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from elastictrain.cluster.env import DistEnv, rendezvous_store
from elastictrain.cluster.handshake import ATTEMPT_KEY
from elastictrain.cluster.job_store import connect
from elastictrain.errors import InitTimeoutError
from elastictrain.inplace import epoch_end
from elastictrain.inplace.spares import SpareNodes, take_over

logger = logging.getLogger(__name__)

# What gloo and c10d say when the process at the other end of a connection is gone.
_PEER_GONE = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|Socket closed|Connection refused|"
    r"ECONNRESET|EPIPE",
    re.IGNORECASE,
)


@dataclass
class LiveState:
    """What a survivor carries into the next epoch."""

    step: int
    """Completed steps its state holds (the step in flight is dropped: its optimizer never ran)."""
    captured: dict
    """The state at ``step``: references to this process's live tensors (``capture``), turned
    into a flat file only on the rank that sends it (nothing touches them before it does)."""
    last_committed: int | None
    failed_seen_at: float
    """Wall-clock time this rank saw the failure."""
    nonce: str = ""
    """The failed epoch's attempt nonce: where its members meet again (:func:`regroup`)."""
    members: list[int] = field(default_factory=list)
    """The failed epoch's members, by torchrun rank (its ranks in order)."""
    counted_in: bool = False
    """Counted back for the next epoch already (:func:`leave`)."""
    layout: str | None = None
    """Sharded state: which chunks ``captured`` holds (``checkpoint.resume.live_shards``)."""
    silent: list[int] = field(default_factory=list)
    """The failed epoch's members (by torchrun rank) found silent (a frozen host): not waited
    for. Non-empty when the epoch ended by a silence, not by a death's reset."""
    error: str = ""
    """What this rank saw fail (its first line): named if every member turns out alive."""


class PeerLost(Exception):
    """A collective failed because a peer's process is gone; the survivor's state goes with it."""

    def __init__(self, carry: LiveState, cause: BaseException) -> None:
        super().__init__(f"a peer's training process is gone at step {carry.step}: {cause}")
        carry.error = carry.error or error_line(cause)
        self.carry = carry


def error_line(error: BaseException) -> str:
    """``error`` in one line, for last words and verdicts."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"


def is_peer_loss(error: BaseException, end: epoch_end.EpochEnd | None) -> bool:
    """Whether ``error`` says a peer's process is gone (not a bug of this rank's own): its own
    words (gloo's reset), or the epoch's collectives failed by its ``end`` (announced, or a
    member silent: an aborted NCCL group fails in many ways, down to "no default process
    group"), whichever thread failed them first."""
    if end is not None and end.failed:
        return True
    for e in _chain(error):
        if isinstance(e, dist.DistError) or (
            isinstance(e, RuntimeError) and _PEER_GONE.search(str(e))
        ):
            return True
    return False


def _chain(error: BaseException | None):
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def next_members(
    env: DistEnv,
    carry: LiveState | None,
    died_at: float | None,
    *,
    wait_s: float,
    timeout_s: float,
    silent_s: float,
    beat_s: float = 0.0,
    store: dist.Store | None = None,
    spares: SpareNodes | None = None,
) -> list[int]:
    """The epoch's members by torchrun rank (``env``: torchrun's): every training rank at a start
    (``spares``: the spare nodes' ranks stand by); after a death, whoever is back (:func:`regroup`),
    with spare nodes in the place of lost ones, agreed through the job's store, which outlives every
    training process. Empty when the epoch went on without this replacement.

    After a silent peer the wait is at least two beats (``beat_s``): only rank 0 watches every
    rank, and the other survivors learn of the silence from its beat, up to a beat later (a
    death, by contrast, resets every survivor's connections at once). ``--replace-wait`` alone
    would drop them with the frozen node. ``store``: the job's (default: connected to here)."""
    if carry is None and died_at is None:
        return list(range(spares.training_world_size if spares else env.world_size))
    if carry is not None and carry.silent:
        wait_s = max(wait_s, 2 * beat_s + 0.5)
    if store is None:
        store = connect(env, timeout_s=timeout_s, silent_s=silent_s, store_up=True).store
    if carry is not None:
        return regroup(
            store,
            carry.nonce,
            carry.members,
            env.rank,
            wait_s=wait_s,
            timeout_s=timeout_s,
            counted=carry.counted_in,
            silent=carry.silent,
            spares=spares,
        )
    found = join_as_replacement(store, env.rank, wait_s=wait_s, timeout_s=timeout_s, spares=spares)
    return found or []


def publish(store: dist.Store, nonce: str, members: list[int]) -> None:
    """Rank 0, as an epoch starts: its members, by torchrun rank, for a replacement to read."""
    store.set(f"{nonce}/members-of", json.dumps(members))


def regroup(
    store: dist.Store,
    nonce: str,
    members: list[int],
    me: int,
    *,
    wait_s: float,
    timeout_s: float,
    counted: bool = False,
    silent: list[int] = (),
    spares: SpareNodes | None = None,
) -> list[int]:
    """Every rank back from the failed epoch ``nonce`` (``members``, by torchrun rank), survivor
    or replacement: the next epoch's members.

    Every member that is back within ``wait_s`` (a survivor, or a dead rank's replacement, which
    a supervisor sends within a tenth of a second) is in; a member that is not (its whole node is
    gone) is dropped, and the epoch continues at the smaller world size. The first rank to claim
    it decides, every other rank reads the decision, so all agree even when a replacement arrives
    at the deadline. One store request per poll (the count), and one look at who came.
    ``counted``: this rank counted itself back already (a survivor, in :func:`leave`).
    ``silent``: members found silent (a frozen host), not waited for: the rest back, the wait ends.
    ``spares``: a spare node, called by the decider, takes the place of each node none of whose
    members is back (``spares.take_over``), in its rank order: the size does not change.
    """
    deadline = time.monotonic() + wait_s
    if not counted:
        _count_in(store, nonce, me, members, silent)
    expected = len([m for m in members if m not in silent])
    if store.add(f"{nonce}/back", 0) < expected:
        # One blocking wait, not a poll: at 8,192 ranks a 10 ms poll is 400,000 requests of one
        # store within the default 0.5 s (the handshake's lesson). Its timeout: whoever is
        # back by then is in (c10d logs the timeout as a warning, once per lost node).
        left = timedelta(seconds=max(0.001, deadline - time.monotonic()))
        with contextlib.suppress(dist.DistStoreError):
            store.wait([_back_count_key(nonce, expected)], left)
    if store.compare_set(f"{nonce}/decider", "", str(me)).decode() == str(me):
        back = [m for m in members if store.check([f"{nonce}/back/{m}"])]
        decided = back
        if spares is not None and spares.count and len(back) < len(members):
            missing = [m for m in members if m not in back]
            taken = take_over(store, spares, nonce, members, missing, answer_s=max(1.0, wait_s))
            if taken:  # read by every member before the members: it is set first
                store.set(took_over_key(nonce), json.dumps(sorted(taken.items())))
            decided = [taken.get(m, m) for m in members if m in back or m in taken]
        store.compare_set(f"{nonce}/members", "", json.dumps(decided))
    return _get_json(store, f"{nonce}/members", me, timeout_s)


def took_over_key(nonce: str) -> str:
    """Where the decider of the epoch after ``nonce`` says which spare took which lost rank's
    place: ``[[lost, spare], ...]`` by torchrun rank; absent when none did."""
    return f"{nonce}/took-over"


def took_over(store: dist.Store, nonce: str) -> list[list[int]]:
    """``took_over_key``'s pairs (empty when no spare took a place)."""
    if not store.check([took_over_key(nonce)]):
        return []
    return json.loads(store.get(took_over_key(nonce)))


def join_as_replacement(
    store: dist.Store,
    me: int,
    *,
    wait_s: float,
    timeout_s: float,
    spares: SpareNodes | None = None,
) -> list[int] | None:
    """A spare told to go (torchrun rank ``me``): the next epoch's members, or None when the
    epoch goes on without this rank (it came back too late)."""
    nonce = store.get(ATTEMPT_KEY).decode()  # the failed epoch's: the next is made after this
    members = _get_json(store, f"{nonce}/members-of", me, timeout_s)
    if me not in members:  # that epoch already went on without this rank
        return None
    members = regroup(store, nonce, members, me, wait_s=wait_s, timeout_s=timeout_s, spares=spares)
    return members if me in members else None


def decided(store: dist.Store, nonce: str, me: int, timeout_s: float) -> list[int]:
    """The members of the epoch after ``nonce``, once its decider wrote them (a called spare
    node's rank reads them here; ``me``: its torchrun rank, for the error)."""
    return _get_json(store, f"{nonce}/members", me, timeout_s)


def _count_in(
    store: dist.Store, nonce: str, me: int, members: list[int], silent: list[int] = ()
) -> None:
    store.set(f"{nonce}/back/{me}", b"1")
    back = store.add(f"{nonce}/back", 1)
    store.set(_back_count_key(nonce, back), b"1")  # what a wait for that many members ends on
    # Every member's watch fails the epoch's collectives.
    epoch_end.announce(store, nonce, members, silent)


def _back_count_key(nonce: str, count: int) -> str:
    return f"{nonce}/back-count/{count}"


def _get_json(store: dist.Store, key: str, me: int, timeout_s: float) -> list[int]:
    original = store.timeout
    store.set_timeout(timedelta(seconds=timeout_s))
    try:
        return json.loads(store.get(key))
    except dist.DistStoreError as e:
        raise InitTimeoutError(
            f"rank {me}: the survivors did not agree on the next epoch's members within "
            f"--replace-timeout ({timeout_s:.0f}s)"
        ) from e
    finally:
        store.set_timeout(original)


def drop_silent(liveness, reason: str, end: epoch_end.EpochEnd | None) -> None:
    """A peer silent past --silent-timeout (a frozen host), in place: fail this epoch's
    collectives now (its ``end``), so the survivors regroup without it, instead of exiting 8 for
    a restart. A silent store is still an exit: nothing can be agreed without it.
    ``liveness``: the epoch's :class:`~elastictrain.cluster.liveness.Liveness`; ``end``: the epoch's
    (None before its groups exist); once closed (the next epoch began), it shuts nothing."""
    if liveness.store_lost:
        liveness.exit_silent(reason)
        return
    liveness.peer_silent = True
    shut = end.fail(f"a member is silent ({reason})") if end is not None else 0
    logger.error(
        "PEER SILENT: %s (--silent-timeout=%gs); this epoch's %d connections shut so the others "
        "go on without it",
        reason,
        liveness.silent_s,
        shut,
    )


def silent_members(liveness, members: list[int], end: epoch_end.EpochEnd | None) -> list[int]:
    """The epoch's ranks ``liveness`` found silent (or heard of from rank 0), as torchrun ranks
    (``members``: the epoch's, in its rank order), or that the epoch's ``end`` was announced
    with (it may be heard before rank 0's beat); empty when it did not end by one."""
    heard = set(end.silent) if end is not None else set()
    if not liveness.peer_silent or not liveness.verdict:
        return sorted(heard)
    found = {members[v["rank"]] for v in liveness.verdict if v["rank"] < len(members)}
    return sorted(found | heard)


def leave(
    carry: LiveState, store: dist.Store | None, me: int, end: epoch_end.EpochEnd | None
) -> None:
    """A survivor, the moment it sees a peer's death (``carry`` names the failed epoch): fail
    every collective of the epoch blocked on this rank (its ``end``: a rank blocked in a
    collective on a survivor, not on the dead rank, would otherwise wait for
    --collective-timeout, since with more than two ranks a ring or a tree passes through others,
    and a survivor's groups keep their sockets open until their last reference goes), then
    count itself back for the next epoch in the job's ``store``. Counted here, before this
    process tears the epoch down (its groups, its liveness thread, its session: seconds on a
    loaded host), since the others wait only ``--replace-wait`` for whoever is not back: a
    survivor late for that would be dropped with the dead rank's node. ``me``: this rank's
    torchrun rank."""
    if end is not None:
        end.fail("this rank left it (a peer's death)")
    if store is not None:
        _count_in(store, carry.nonce, me, carry.members, carry.silent)
        carry.counted_in = True


def store_port(env: DistEnv) -> int:
    """The job store's port (``env``: torchrun's): its connections are never the epoch's."""
    store = rendezvous_store(env)
    return store.port if store else env.master_port

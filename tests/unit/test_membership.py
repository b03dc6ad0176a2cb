"""elastictrain.inplace.members: who is in the next epoch after a death, agreed through a real
TCPStore, and which errors mean a peer's process is gone."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from elastictrain.cluster.handshake import ATTEMPT_KEY
from elastictrain.inplace import agreement
from elastictrain.inplace import members as membership
from elastictrain.inplace.members import (
    LiveState,
    is_peer_loss,
    join_as_replacement,
    publish,
    regroup,
)


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10))


def _client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10))


def _back(server, nonce, members, ranks, results, *, wait_s=0.3, late=()):
    def one(r):
        if r in late:
            time.sleep(wait_s + 0.5)
            results[r] = join_as_replacement(_client(server), r, wait_s=wait_s, timeout_s=5)
            return
        results[r] = regroup(_client(server), nonce, members, r, wait_s=wait_s, timeout_s=5)

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)


def test_everyone_back_decides_at_once_without_waiting():
    server = _store()
    server.set(ATTEMPT_KEY, "n1")
    publish(server, "n1", [0, 1, 2])
    results: dict = {}
    t0 = time.monotonic()
    _back(server, "n1", [0, 1, 2], [0, 1, 2], results, wait_s=5.0)
    assert time.monotonic() - t0 < 2.0  # not the 5 s wait: the count was full
    assert results == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}


def test_a_member_found_silent_is_not_waited_for():
    """A frozen host's rank (named by liveness) never comes back: once every other member is
    back the epoch is decided, instead of at the end of the longer wait a silence gets (the
    others hear of it a beat late)."""
    server = _store()
    server.set(ATTEMPT_KEY, "n4")
    results: dict = {}

    def one(r):
        results[r] = regroup(
            _client(server), "n4", [0, 1, 2], r, wait_s=5.0, timeout_s=5, silent=[2]
        )

    threads = [threading.Thread(target=one, args=(r,)) for r in (0, 1)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert time.monotonic() - t0 < 2.0  # not the 5 s wait
    assert results == {0: [0, 1], 1: [0, 1]}


def test_silent_members_are_the_verdicts_ranks_as_torchrun_ranks():
    liveness = SimpleNamespace(peer_silent=True, verdict=[{"rank": 1, "host": "h", "silent_s": 4}])
    assert membership.silent_members(liveness, [0, 2, 3], None) == [2]
    liveness.peer_silent = False  # the epoch ended by a death, not this silence
    assert membership.silent_members(liveness, [0, 2, 3], None) == []


def test_a_member_not_back_within_the_wait_is_dropped_and_a_late_one_learns_it():
    """Rank 2's node is gone (never back); rank 3's replacement comes after the decision: both are
    out, every rank that is back agrees on the same members, the late one gets None."""
    server = _store()
    server.set(ATTEMPT_KEY, "n2")
    publish(server, "n2", [0, 1, 2, 3])
    results: dict = {}
    _back(server, "n2", [0, 1, 2, 3], [0, 1, 3], results, late=(3,))
    assert results == {0: [0, 1], 1: [0, 1], 3: None}


def test_a_survivor_counted_back_as_it_leaves_is_not_counted_again(monkeypatch):
    """Survivors count themselves back the moment they see the death (``leave``), before their
    teardown; their regroup must not count them a second time, or the count is full before the
    dead rank's replacement is back, which is then dropped with its node."""
    shut = []
    server = _store()
    server.set(ATTEMPT_KEY, "n3")
    publish(server, "n3", [0, 1, 2])
    results: dict = {}
    for r in (0, 2):  # survivors; rank 1 died
        carry = LiveState(5, {}, None, time.time(), nonce="n3", members=[0, 1, 2])
        end = SimpleNamespace(fail=lambda why, r=r: shut.append(SimpleNamespace(rank=r)))
        membership.leave(carry, _client(server), r, end)
        assert carry.counted_in

    def survivor(r):
        results[r] = regroup(
            _client(server), "n3", [0, 1, 2], r, wait_s=2.0, timeout_s=5, counted=True
        )

    def replacement():
        time.sleep(0.5)  # its spare is told to go, then joins
        results[1] = join_as_replacement(_client(server), 1, wait_s=2.0, timeout_s=5)

    threads = [threading.Thread(target=survivor, args=(r,)) for r in (0, 2)]
    threads.append(threading.Thread(target=replacement))
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}
    assert [env.rank for env in shut] == [
        0,
        2,
    ]  # each failed every collective blocked on it before counting in


def test_peer_loss_is_told_from_this_ranks_own_errors():
    gone = RuntimeError("[pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer. ...")
    assert is_peer_loss(gone, None)
    wrapped = ValueError("step failed")
    wrapped.__cause__ = gone
    assert is_peer_loss(wrapped, None)
    assert not is_peer_loss(RuntimeError("CUDA out of memory"), None)
    assert not is_peer_loss(ValueError("bad batch"), None)


def test_a_death_that_recurs_is_refused_and_the_verdict_stops_the_next_attempt_at_once():
    """Rank 0 counts each lost torchrun rank's deaths by step in the job's store (torchrun's: it
    outlives every attempt). A second death of rank 1 at step 30 is refused; then a new attempt
    (torchrun's restart: nobody lost) stops at once on the verdict, instead of training into it."""
    from elastictrain.errors import RecurringFailureError

    server = _store()
    agreement._refuse_recurring([1], 30, group=None, store=_client(server), rank=0)
    agreement._refuse_recurring([1], 31, group=None, store=_client(server), rank=0)
    with pytest.raises(
        RecurringFailureError, match="rank 1's training process died twice at step 30"
    ):
        agreement._refuse_recurring([1], 30, group=None, store=_client(server), rank=0)
    with pytest.raises(RecurringFailureError, match="died twice at step 30"):
        agreement._refuse_recurring([], 0, group=None, store=_client(server), rank=0)


def test_an_error_with_every_member_back_is_refused_when_it_recurs_at_its_step():
    """Any DistError reads as a peer's loss, and an epoch whose members all come back replaced
    nobody, so the recurring-death check never counted it: a failure that is no peer's loss
    regrouped forever (the runner's epoch loop is ``while True``). Once at a step it may be a
    transient reset; a second time there it is refused, naming the error, and the verdict stops
    a restart too. (Seen failing before: the third agreement regrouped again.)"""
    from elastictrain.errors import RecurringFailureError

    server = _store()
    members = [0, 1, 2]

    def survivor(step: int, error: str) -> LiveState:
        carry = LiveState(step, {}, None, time.time(), nonce="n", members=members)
        carry.error = error
        return carry

    agree_args = {"group": None, "store": _client(server), "rank": 0, "members": [0]}
    bug = "DistBackendError: a bug in a custom collective"
    agreement.agree(survivor(30, bug), None, **agree_args)  # once: maybe a transient reset
    agreement.agree(survivor(31, bug), None, **agree_args)  # another step: counted apart
    with pytest.raises(RecurringFailureError, match=r"failed twice at step 30.*a bug in a custom"):
        agreement.agree(survivor(30, bug), None, **agree_args)
    with pytest.raises(RecurringFailureError, match="failed twice at step 30"):  # the restart
        agreement.agree(None, None, **agree_args)
    # An epoch that did lose a member is the recurring-death check's (one rank twice), never
    # this one's: two different ranks lost at one step are two deaths, and go on.
    other_job = _store()
    agree_args["store"] = _client(other_job)
    for lost in (2, 1):
        agreement.agree(survivor(30, bug), None, **agree_args, dropped=[lost])


def test_a_spare_node_taking_a_place_is_no_death_of_its_own():
    """Epoch ranks 0 (torchrun 0, a survivor at step 30) and 1 (torchrun 4, a spare in lost rank
    2's place). The spare is a newcomer, not a process that died: the recurring-death count is
    rank 2's alone, so a later death of rank 4 at that step would be its first. (Seen failing
    without ``took_over``: rank 4 counted as lost at step 30.)"""
    survivor = LiveState(30, {}, None, time.time(), nonce="n", members=[0, 2])
    spare = (-1, None, None, time.time(), 0, "")

    class Both:  # the all-gather of the two members, seen from rank 0
        @staticmethod
        def all_gather_object(mine, group):
            return [mine, spare]

        @staticmethod
        def broadcast_bytes(value, group):
            return value

    server = _store()
    agreement.agree(
        survivor,
        None,
        group=None,
        store=_client(server),
        rank=0,
        members=[0, 4],
        dropped=[2],
        took_over=[[2, 4]],
        collectives=Both,
    )
    assert server.add("elastictrain/lost/rank-2/step-30", 0) == 1
    assert server.add("elastictrain/lost/rank-4/step-30", 0) == 0


class _Counting:
    """A store client that counts the requests made of it (every method goes through)."""

    def __init__(self, store: dist.Store) -> None:
        self.store, self.requests = store, 0

    def __getattr__(self, name: str):
        method = getattr(self.store, name)
        if not callable(method):  # an attribute (its timeout): no request
            return method

        def counted(*args, **kwargs):
            self.requests += 1
            return method(*args, **kwargs)

        return counted


def test_a_rank_waiting_for_the_others_makes_a_few_requests_not_a_poll():
    """Who is back is waited for with one blocking store wait: a rank back first, waiting 1 s for
    a late member, made one request per 10 ms poll before (about 100; at 8,192 ranks, 400,000
    requests of one store in the default 0.5 s). It still decides as soon as the last is back."""
    server = _store()
    server.set(ATTEMPT_KEY, "n5")
    publish(server, "n5", [0, 1])
    first = _Counting(_client(server))
    results: dict = {}

    def early() -> None:
        results[0] = regroup(first, "n5", [0, 1], 0, wait_s=5.0, timeout_s=5)

    thread = threading.Thread(target=early)
    t0 = time.monotonic()
    thread.start()
    time.sleep(1.0)
    results[1] = regroup(_client(server), "n5", [0, 1], 1, wait_s=5.0, timeout_s=5)
    thread.join(10)
    assert time.monotonic() - t0 < 3.0  # decided once rank 1 was back, not at the 5 s wait
    assert results == {0: [0, 1], 1: [0, 1]}
    assert first.requests <= 20, first.requests  # 13 when it decides: not one per 10 ms

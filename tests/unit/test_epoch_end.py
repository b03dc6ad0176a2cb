"""elastictrain.inplace.epoch_end: an epoch's end, announced once in the job's store, fails the epoch's
collectives on every member at once, even one blocked on a live peer (what NCCL does to every
survivor of a death); and never touches the next epoch's."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastictrain.cluster.connections import EpochConnections, break_collectives
from elastictrain.inplace import epoch_end
from tests.helpers.paths import REPO_ROOT


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30))


def _probe(rank: int, port: int, nonce: str, blocked: int) -> subprocess.Popen:
    probe = ("tests.helpers.epoch_watch_probe", str(rank), str(port), nonce, str(blocked))
    return subprocess.Popen(
        [sys.executable, "-m", *probe],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _blocked_all_reduce_after_the_end_is_announced(blocked: int, wait_s: float = 20) -> dict:
    server = _store()
    procs = [_probe(r, server.port, "n1", blocked) for r in (0, 1)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # the blocked rank is inside its all-reduce, waiting on the other
        # What a dead peer's replacement does first.
        epoch_end.announce(server, "n1", [0, 1], [1 - blocked])
        deadline = time.monotonic() + wait_s
        while procs[blocked].poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if procs[blocked].poll() is None:
            return {"raised": False, "blocked_for_s": wait_s}
        return json.loads(procs[blocked].stdout.read().strip().splitlines()[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.mark.parametrize("blocked", [0, 1])
def test_a_collective_blocked_on_a_live_peer_fails_when_the_epochs_end_is_announced(blocked):
    """Without the watch the all-reduce stays blocked for the peer's 120 s (seen: with the
    abort taken out of the watch, this fails). Only the epoch's connections are shut: a user's
    (opened before the epoch, or while it trains) still carries bytes; every TCP connection of
    the process was shut before (seen: both False). Which end of the pair dialed is gloo's
    choice; the test below takes each side in turn."""
    got = _blocked_all_reduce_after_the_end_is_announced(blocked)
    assert got["raised"], got
    assert got["after_s"] < 15, got  # 1 s after it began, on an idle host
    assert got["peer_loss"], got  # the survivor leaves with its state, as after a reset
    assert got["silent"] == [1 - blocked], got  # what the announcer found silent reaches all
    assert got["own_connections_carry"] == [True, True], got


def test_a_closed_watch_ignores_the_end_and_the_first_announcement_stands(monkeypatch):
    aborted = []
    monkeypatch.setattr(
        epoch_end, "abort_collectives", lambda port, connections: aborted.append(port) or 0
    )
    server = _store()
    closed = epoch_end.EpochEnd("old", server.port, member=0).watch(server)
    closed.close()  # the epoch's groups are gone; the next epoch's must not be touched
    live = epoch_end.EpochEnd("new", server.port, member=0).watch(server)
    epoch_end.announce(server, "old", [0, 3])
    epoch_end.announce(server, "new", [0, 3], [3])
    epoch_end.announce(server, "new", [0, 3], [])  # a later member back: the first one stands
    deadline = time.monotonic() + 10
    while not live.failed and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)  # the closed watch, had it acted, would have by now
    assert live.failed and not closed.failed
    assert aborted == [server.port]
    assert live.silent == [3]
    live.close()  # once closed, nothing fails the epoch's collectives again
    assert live.fail("late") == 0 and aborted == [server.port]


def test_closing_a_members_last_epoch_ends_its_watch_and_wakes_no_other_member(monkeypatch):
    """A watch still blocked in its store wait when the interpreter finalizes aborts the process
    if that wait returns then (its key set, or the store's host exiting first): CPython ends the
    thread inside torch's C++ frames ("terminate called without an active exception", SIGABRT;
    a CI run: library mode's rank 0 after a clean finish, and torchrun counted a failure). So a
    member closing its last epoch wakes its own watch and joins it (seen failing: the thread
    still alive after close). The other members' watches are not woken: they still hear a
    real end."""
    aborted = []
    monkeypatch.setattr(
        epoch_end, "abort_collectives", lambda port, connections: aborted.append(port) or 0
    )
    server = _store()
    mine = epoch_end.EpochEnd("n5", server.port, member=0).watch(server)
    theirs = epoch_end.EpochEnd("n5", server.port, member=1).watch(server)
    time.sleep(0.3)  # both inside their waits
    t0 = time.monotonic()
    mine.close(wait=True)
    assert not mine._thread.is_alive() and time.monotonic() - t0 < 2
    time.sleep(0.3)  # another member's watch, had the close woken it, would have failed by now
    assert theirs._thread.is_alive() and not theirs.failed and not mine.failed
    epoch_end.announce(server, "n5", [0, 1], [0])
    theirs._thread.join(5)
    assert theirs.failed and theirs.silent == [0] and aborted == [server.port]


def test_nccl_in_place_is_refused_unless_asked_for_and_then_keeps_nccls_watchdog_off(monkeypatch):
    import pytest
    import torch

    from elastictrain.errors import ConfigError

    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("ELASTICTRAIN_NCCL_IN_PLACE", raising=False)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    with pytest.raises(ConfigError, match="ELASTICTRAIN_NCCL_IN_PLACE=1.*drop --replace-in-place"):
        epoch_end.refuse_unverified_nccl(cuda, "--replace-in-place")
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
    monkeypatch.setenv("ELASTICTRAIN_NCCL_IN_PLACE", "1")
    epoch_end.refuse_unverified_nccl(cuda, "--replace-in-place")
    epoch_end.prepare_nccl()  # the driver's, as it builds a CUDA epoch's groups
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    # The gate: on CUDA always (the device waited for); on the CPU a barrier with replicas only.
    assert callable(epoch_end.update_gate(cuda, twins=False, end=None))
    assert epoch_end.update_gate(torch.device("cpu"), twins=True, end=None) is dist.barrier
    assert epoch_end.update_gate(torch.device("cpu"), twins=False, end=None) is None


@pytest.fixture
def tcp():
    """Open TCP sockets on loopback (``tcp.listen()``, ``tcp.connect(listener)``,
    ``tcp.accept(listener)``), every one closed at teardown."""
    with contextlib.ExitStack() as opened:

        class Tcp:
            def listen(self) -> socket.socket:
                return opened.enter_context(socket.create_server(("127.0.0.1", 0)))

            def connect(self, listener: socket.socket) -> socket.socket:
                return opened.enter_context(socket.create_connection(listener.getsockname()))

            def accept(self, listener: socket.socket) -> socket.socket:
                return opened.enter_context(listener.accept()[0])

        yield Tcp()


def _shut(sock: socket.socket) -> bool:
    """Shut from this end: end of stream at once, nothing blocks."""
    sock.setblocking(False)
    return sock.recv(1) == b""


def _carries(sender: socket.socket, receiver: socket.socket) -> bool:
    sender.sendall(b"x")
    return receiver.recv(1) == b"x"


def test_the_epochs_end_shuts_its_groups_connections_from_either_end_and_nothing_else(
    gloo_world, tcp
):
    """A connection is the epoch's when one end is a listener a member's groups opened: this
    rank's own (it accepted the connection) or another member's (it dialed one). Each is shut
    from this end; a user's connection, opened once training runs, is left alone, as is the
    job's store. (Seen failing with the dialed rule taken out: the dial to a member stays open.)"""
    ledger = EpochConnections()
    member = tcp.listen()  # a member's gloo listener: never accepted here (its end is not ours)
    mine = tcp.listen()
    ledger.learn(gloo_world)  # the groups are built: their listeners recorded
    dialed, caller = tcp.connect(member), tcp.connect(mine)
    accepted = tcp.accept(mine)
    user = tcp.listen()  # a listener opened while training runs
    user_client = tcp.connect(user)
    user_accepted = tcp.accept(user)
    shut = break_collectives(keep_port=-1, connections=ledger)
    assert shut == 3  # the dial to a member's listener; both ends of the one to ours
    assert _shut(dialed) and _shut(accepted) and _shut(caller)
    assert _carries(user_client, user_accepted)


def test_a_watch_that_fails_says_so_at_warning(caplog):
    """The watch caught every error and logged it at DEBUG: an epoch whose end could no longer be
    heard said nothing. (Seen failing before: no record at WARNING.)"""

    class Unreachable:
        def clone(self):
            raise ConnectionRefusedError("the job's store is gone")

    with caplog.at_level("WARNING", logger="elastictrain.inplace.epoch_end"):
        watch = epoch_end.EpochEnd("n9", 1, member=0).watch(Unreachable())
        watch._thread.join(5)
    said = [r for r in caplog.records if r.levelname == "WARNING"]
    assert said and "n9 stopped (ConnectionRefusedError" in said[0].getMessage()
    assert not watch.failed
    watch.close()


def test_a_silence_heard_late_shuts_its_own_epochs_connections_never_the_next_ones(
    monkeypatch, gloo_world, tcp
):
    """A survivor's liveness thread of the failed epoch may find the silence after the next epoch
    has built its groups (seen in a fresh-clone CI run: the next epoch's agreement failed, and
    torchrun restarted the group). The silence shuts the connections of the epoch it watched:
    each epoch's liveness is bound to that epoch's ledger, not to whichever epoch is current."""
    from types import SimpleNamespace

    from elastictrain.inplace import members

    failed = EpochConnections()
    failed_listener = tcp.listen()
    failed.learn(gloo_world)
    following = EpochConnections()
    following_listener = tcp.listen()
    following.learn(gloo_world)
    to_failed, to_following = tcp.connect(failed_listener), tcp.connect(following_listener)
    accepted = tcp.accept(following_listener)
    liveness = SimpleNamespace(store_lost=False, peer_silent=False, silent_s=4.0)
    members.drop_silent(
        liveness, "no heartbeat from rank 2", epoch_end.EpochEnd("n8", -1, failed, member=0)
    )
    assert _shut(to_failed) and liveness.peer_silent
    assert _carries(to_following, accepted)

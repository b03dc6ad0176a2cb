"""Liveness on the two-node recipe (examples/two_nodes.sh, default flags): a node stopped for 10 s
(agent and workers SIGSTOPped, then SIGCONT: a swap storm, a long GC) is waited for, while a node
that stays frozen, its sockets open, is found by the heartbeats and the survivor trains again
without it in well under the 600 s --collective-timeout it used to cost."""

from __future__ import annotations

import signal
import socket
import time
import uuid

import pytest

from elastictrain.observe.events import Cause, Event, read_events
from tests.helpers.launcher import TWO_NODES as SCRIPT
from tests.helpers.launcher import (
    job_env,
    node_env,
    off_node_agent,
    store_server,
    wait_for_event,
)
from tests.helpers.net import free_port


@pytest.mark.slow
def test_a_paused_node_is_waited_for_and_a_frozen_node_is_dropped_within_a_minute(launch, tmp_path):
    port, run_id = free_port(), f"frozen-{uuid.uuid4().hex[:6]}"
    ckpt, ev = str(tmp_path / "shared"), str(tmp_path / "ev.jsonl")
    args = ["--max-steps", "100000", "--checkpoint-every-steps", "40", "--event-log", ev]
    args += ["--log-every-seconds", "0.5", "--task-option", "step_time=0.1"]
    nodes = []
    for node in (0, 1):
        home = tmp_path / f"host{node}"
        home.mkdir()
        env = node_env(node, port, run_id, ckpt)
        nodes.append(launch(args, script=SCRIPT, env=env, cwd=str(home), name=f"node{node}"))
    wait_for_event(
        ev, lambda e: e["event"] == Event.PROGRESS and e["world_size"] == 2 and e["step"] >= 45, 150
    )
    # A 10 s stop of the whole node, then it continues: nobody may be declared silent.
    nodes[1].signal_node(signal.SIGSTOP)
    time.sleep(10)
    nodes[1].signal_node(signal.SIGCONT)
    t_thaw = time.time()
    progressed = wait_for_event(
        ev, lambda e: e["event"] == Event.PROGRESS and e["time"] > t_thaw + 5, 60, nodes[0]
    )
    assert progressed["world_size"] == 2
    assert not [e for e in read_events(ev) if e["event"] in (Event.EXIT, Event.MEMBERSHIP)
                and e["time"] > t_thaw - 20]  # fmt: skip
    # Now the node stays frozen: its sockets stay open, so only the heartbeats can tell.
    t_freeze = time.time()
    nodes[1].signal_node(signal.SIGSTOP)
    try:
        alone = wait_for_event(
            ev, lambda e: e["event"] == Event.FIRST_STEP and e["time"] > t_freeze, 120, nodes[0]
        )
        exits = [e for e in read_events(ev) if e["event"] == Event.EXIT and e["time"] > t_freeze]
    finally:
        nodes[1].kill()
    took = alone["time"] - t_freeze
    assert took <= 60, f"training again {took:.1f}s after the freeze"
    shrunk = [e for e in read_events(ev) if e["event"] == Event.MEMBERSHIP]
    assert shrunk and shrunk[-1]["new_world_size"] == 1 and shrunk[-1]["time"] <= alone["time"]
    # The survivor's last words name how it knew and whom: the silent rank and its host (the
    # workers share torchrun's rendezvous store, in node 0's agent, so it never froze with node 1).
    assert exits and all(e["cause"] == Cause.PEER_SILENT for e in exits), exits
    host = socket.gethostname()
    assert any(f"on host {host}" in e["detail"] for e in exits), exits
    print(f"frozen node: training again after {took:.1f}s; last words: {exits[0]['detail']}")


@pytest.mark.slow
def test_frozen_nodes_are_dropped_while_two_or_more_survive_whichever_holds_rank_0(
    launch, tmp_path
):
    """Issue 33, on torch's defaults (torchrun shares its agent's store with the workers) with the
    rendezvous store off the nodes, as docs/multinode.md advises: 4 nodes of 1 rank. A node
    without rank 0 freezes (4 -> 3), then the node holding rank 0 (3 -> 2): the survivors' agents
    hand the workers the frozen node's store address (torch caches it), so the restart must not
    depend on it. Each time the survivors train again at the smaller size within 60 s, where the
    bug waited for --init-timeout (900 s).

    Why 60 s, not the issue's 30 s: with default flags the recovery takes 19-22 s on an idle
    host (12 runs of 12, ``python -m tests.helpers.freeze_host``, docs/faults.md), but the
    suite's load on 2 cores stretched it to 39 s, and to 32 s even with beats every 1 s and a 6 s
    silence (these flags, which keep detection short so the bound is spent on the restart; the
    test above keeps the defaults). The bound is the two-node test's."""
    port, run_id = free_port(), f"frozen3-{uuid.uuid4().hex[:6]}"
    ckpt, ev = str(tmp_path / "shared"), str(tmp_path / "ev.jsonl")
    env = job_env()
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # torch's default: the shared store
    with store_server(port):
        nodes = []
        for node in range(4):
            home = tmp_path / f"host{node}"
            home.mkdir()
            args = ["--checkpoint-dir", ckpt, "--local-checkpoint-dir", str(home / "tier")]
            args += ["--max-steps", "100000", "--checkpoint-every-steps", "40"]
            args += ["--event-log", ev, "--log-every-seconds", "0.5"]
            args += ["--task-option", "step_time=0.05", "--heartbeat-seconds", "1"]
            args += ["--silent-timeout", "6"]
            targs = off_node_agent("2:4", port, run_id)
            nodes.append(launch(args, torchrun_args=targs, env=env, cwd=str(home), name=f"n{node}"))
        full = wait_for_event(ev, lambda e: e["event"] == Event.START and e["world_size"] == 4, 150)
        # Its first step too: a freeze between the start and that step let the attempt's own
        # first step pass for "training again", with no start after the freeze (a CI run).
        wait_for_event(
            ev, lambda e: e["event"] == Event.FIRST_STEP and e["time"] > full["time"], 60
        )
        took, first_words = {}, []
        for size, rank0 in ((3, False), (2, True)):
            live = [n for n in nodes if n.proc.poll() is None and n.workers()]
            frozen = next(n for n in live if (0 in n.workers()) == rank0)
            nodes.remove(frozen)
            t_freeze = time.time()
            frozen.signal_node(signal.SIGSTOP)
            again = wait_for_event(
                ev, lambda e, t=t_freeze: e["event"] == Event.FIRST_STEP and e["time"] > t, 90
            )
            took[size] = again["time"] - t_freeze
            started = _between(ev, Event.START, t_freeze, again["time"])
            assert started and started[-1]["world_size"] == size, started
            # The first to leave is a watcher that found the silence; the others may then see the
            # connection to it close first (a gloo error), which is no timeout either.
            exits = sorted(
                _between(ev, Event.EXIT, t_freeze, again["time"]), key=lambda e: e["time"]
            )
            first_words.append(exits[0] if exits else None)
        for node in nodes:
            node.kill()
    assert all(e and e["cause"] == Cause.PEER_SILENT for e in first_words), first_words
    # With the store off the frozen node, the survivors name the silent rank, not the store.
    assert "no heartbeat from rank 0" in first_words[1]["detail"], first_words
    print(
        f"frozen node -> training again: {took[3]:.1f}s (4 -> 3), {took[2]:.1f}s (3 -> 2, rank 0)"
    )
    assert took[3] <= 60 and took[2] <= 60, took


def _between(path: str, kind: Event, after: float, before: float) -> list[dict]:
    return [e for e in read_events(path) if e["event"] == kind and after < e["time"] < before]


@pytest.mark.slow
def test_a_node_lost_while_the_job_starts_costs_torchruns_keep_alive_not_the_init_timeout(
    launch, tmp_path
):
    """Issue 46: node 1's agent and workers SIGKILLed while its rank still builds its task,
    before any step. Node 0's rank waited in the handshake for a rank that would never come until
    --init-timeout (900 s; 70.5 s with --init-timeout 60): a rank that never started is absent,
    not silent. Its liveness probe now reads torchrun's round each beat, and once the surviving
    agent's keep-alive has removed the lost node (the recipe's 3 s) the rank exits 8 naming it,
    and torchrun re-forms the group without node 1. (Seen failing without the start watch:
    still waiting 90 s after the kill.)"""
    port, run_id = free_port(), f"startlost-{uuid.uuid4().hex[:6]}"
    ckpt, ev = str(tmp_path / "shared"), str(tmp_path / "ev.jsonl")
    args = ["--max-steps", "60", "--checkpoint-every-steps", "20", "--event-log", ev]
    nodes = []
    for node in (0, 1):
        home = tmp_path / f"host{node}"
        home.mkdir()
        env = node_env(node, port, run_id, ckpt)
        slow = ["--task-option", "build_delay=60"] if node == 1 else []  # node 1: slow to start
        nodes.append(launch(args + slow, script=SCRIPT, env=env, cwd=str(home), name=f"node{node}"))
    deadline = time.monotonic() + 90
    while not (nodes[0].workers() and nodes[1].workers()):  # both nodes' ranks started
        assert time.monotonic() < deadline, nodes[0].log()[-2000:] + nodes[1].log()[-2000:]
        time.sleep(0.2)
    time.sleep(3.0)  # node 0's rank in the handshake; node 1's inside its 60 s task build
    t_kill = time.time()
    nodes[1].kill()  # the node lost: its agent and every process under it
    alone = wait_for_event(
        ev, lambda e: e["event"] == Event.FIRST_STEP and e["time"] > t_kill, 90, nodes[0]
    )
    assert nodes[0].wait(120) == 0, nodes[0].log()[-3000:]
    took = alone["time"] - t_kill
    assert took < 45, f"training again {took:.1f}s after the kill"
    log = nodes[0].log()
    assert "stopped keeping it alive while the job started" in log, log[-3000:]
    starts = [e for e in read_events(ev) if e["event"] == Event.START]
    assert [(e["world_size"], e["restart_count"]) for e in starts] == [(1, 1)], starts
    print(f"\nnode lost while starting: training again {took:.1f}s after the kill")

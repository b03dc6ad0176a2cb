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
from tests.helpers.launcher import node_env, wait_for_event
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
    # The survivor's last words name how it knew and whom: the silent rank and its host, or the
    # store when the frozen node held it (the workers' store lives in rank 0's process).
    assert exits and all(e["cause"] == Cause.PEER_SILENT for e in exits), exits
    host = socket.gethostname()
    assert any(f"on host {host}" in e["detail"] or "store stopped answering" in e["detail"]
               for e in exits), exits  # fmt: skip
    print(f"frozen node: training again after {took:.1f}s; last words: {exits[0]['detail']}")

"""Nodes checked before they train, with real torchrun agents: a node whose self-check fails at the
start is left out, through torchrun's re-rendezvous without --replace-in-place, and in place with
a spare node taking its ranks with it. (The checks and the judgement: tests/unit/test_self_check.py;
a failing node the job cannot do without: the same unit tests, and exit 2 by hand in the note.)"""

from __future__ import annotations

import sys
import uuid

import pytest

from elastictrain import knobs
from elastictrain.observe.events import Event, read_events
from elastictrain.observe.timeline import build_timeline
from tests.helpers.launcher import (
    TWO_NODES,
    job_env,
    node_env,
    off_node_agent,
    store_server,
    toy_args,
)
from tests.helpers.net import free_port

STEPS = 60


def _starts(events: list[dict]) -> list[tuple]:
    return [
        (e["world_size"], e["restart_count"], e.get("took_over"))
        for e in events
        if e["event"] == Event.START
    ]


@pytest.mark.slow
def test_a_node_failing_its_self_check_leaves_and_torchrun_reforms_the_group_without_it(
    launch, tmp_path
):
    """The two-node recipe, node 1 launched under ``chaos --fault unhealthy-node``: its rank's
    compute check is wrong at the start. The check names its node (a ``self_check`` event,
    ``restart``); its rank exits 9 and stops its agent with SIGTERM; the other rank exits so
    torchrun re-forms the group without it; the job finishes alone, from step 0. (Seen failing
    with the judgement's compute verdict left out: both nodes trained.)"""
    port, run_id = free_port(), f"check-{uuid.uuid4().hex[:6]}"
    ckpt, ev = str(tmp_path / "shared"), str(tmp_path / "ev.jsonl")
    args = toy_args(ckpt, ev, max_steps=STEPS, every=1000)[2:]
    healthy = launch(args, script=TWO_NODES, env=node_env(0, port, run_id, ckpt), name="node0")
    chaos = [sys.executable, "-m", "elastictrain", "chaos", "--fault", "unhealthy-node"]
    chaos += ["--log", str(tmp_path / "node1-job.log"), "--", *TWO_NODES]
    unhealthy = launch(args, script=chaos, env=node_env(1, port, run_id, ckpt), name="node1")
    assert healthy.wait(150) == 0, healthy.log()[-3000:]
    assert unhealthy.wait(60) == 1, unhealthy.log()[-3000:]  # chaos: its job did not finish
    assert "fault 1: unhealthy-node" in unhealthy.log()
    job_log = (tmp_path / "node1-job.log").read_text()
    assert "FAILED (exit 9): NodeUnhealthyError" in job_log, job_log[-3000:]

    events = read_events(ev)
    (check,) = [e for e in events if e["event"] == Event.SELF_CHECK]
    assert check["action"] == "restart" and len(check["ranks"]) == 1, check
    ((node, reasons),) = check["failed"].items()
    assert "compute check of rank(s)" in reasons[0] and "is wrong" in reasons[0], reasons
    assert [f["exact"] for f in check["findings"]] == [False]
    assert _starts(events) == [(2, 0, None), (1, 1, None)]
    began = build_timeline(events).attempts[1].began
    assert began == "a node that failed its self-check left out, shrunk 2 -> 1", began
    (end,) = [e for e in events if e["event"] == Event.END]
    assert end["step"] == STEPS and end["steps_this_attempt"] == STEPS


@pytest.mark.slow
def test_a_node_failing_its_self_check_at_the_start_hands_its_ranks_to_a_healthy_spare_in_place(
    launch, tmp_path
):
    """Four simulated nodes of one rank, the rendezvous store off them, ``--replace-in-place
    --spare-nodes 2``: torchrun ranks 0 and 1 train, 2 and 3 stand by. Rank 1's compute check is
    wrong at the start, and so is spare rank 2's (the knob names the ranks, whichever node the
    rendezvous gives them). Spare 2 leaves before it stands by; rank 1 is left out in place, and
    spare 3 takes its position before any step. The world size stays 2, torchrun restarts
    nothing, and the nodes still in the job exit 0. (Seen failing with the failing rank not
    leaving: it went on to its first step alone, and the job never finished; and with the
    spare's check before it stands by left out: spare 2 stood by, failed the check it runs when
    called, and spare 3 took the place, so the log line is what tells the two apart.)"""
    port, run_id = free_port(), f"check-{uuid.uuid4().hex[:6]}"
    ckpt, ev = str(tmp_path / "shared"), str(tmp_path / "ev.jsonl")
    run = ["--checkpoint-dir", ckpt, *toy_args(ckpt, ev, max_steps=STEPS, every=1000)[2:]]
    run += ["--replace-in-place", "--max-replacements", "0", "--spare-nodes", "2"]
    env = job_env(**{knobs.UNHEALTHY: "compute:1,2"})
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # torch's default: the shared store
    with store_server(port):
        nodes = []
        for node in range(4):
            home = tmp_path / f"host{node}"
            home.mkdir()
            targs = off_node_agent("4", port, run_id)
            nodes.append(launch(run, torchrun_args=targs, env=env, cwd=str(home), name=f"n{node}"))
        codes = [node.wait(150) for node in nodes]
    assert sorted(codes) == [0, 0, 1, 1], [n.log()[-2000:] for n in nodes]
    logs = "\n".join(n.log() for n in nodes)
    assert "spare node's rank 2, before it stood by, failed its self-check" in logs, logs[-4000:]

    events = read_events(ev)
    (check,) = [e for e in events if e["event"] == Event.SELF_CHECK]
    assert (check["action"], check["ranks"], check["spares"]) == ("in place", [1], 1), check
    assert _starts(events) == [(2, 0, None), (2, 0, [[1, 3]])]
    began = build_timeline(events).attempts[1].began
    assert began.startswith("a node that failed its self-check left out, taken over by a spare")
    resumes = [e for e in events if e["event"] == Event.RESUME]
    assert [e["step"] for e in resumes] == [0, 0] and resumes[1].get("tier") == "live", resumes
    (end,) = [e for e in events if e["event"] == Event.END]
    assert end["step"] == STEPS

"""--replace-in-place with sharded state: HSDP heals a replaced rank from its twin in another
replica and drops a lost replica's node; FSDP without replicas rolls every rank back in memory to
the fast tier's newest whole copy. Nobody else's process restarts."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

import storage
from elastictrain.observe.events import Event, read_events, read_sample_log
from elastictrain.tools.chaos import descendants
from storage.manifest import step_dir_name
from tests.helpers.elastic import assert_exactly_once
from tests.helpers.launcher import (
    TWO_NODES,
    assert_bitwise_equal,
    final_state,
    job_env,
    node_env,
    toy_args,
    wait_for_event,
    wait_for_spares,
)
from tests.helpers.net import free_port
from tests.helpers.restart_loop import wait_for_count

DATA = ("--task-option", "dataset_size=1024", "--task-option", "batch_size=32")


def _epoch_began(events: str, n: int, job) -> dict:
    """Membership epoch ``n``'s (0-based) first completed step."""
    wait_for_count(events, Event.FIRST_STEP, n + 1, 120, job)
    return [e for e in read_events(events) if e["event"] == Event.FIRST_STEP][n]


def _resume_after(events: list[dict], start: dict) -> dict:
    return next(e for e in events if e["event"] == Event.RESUME and e["time"] >= start["time"])


@pytest.mark.slow
def test_hsdp_heals_replaced_ranks_from_their_twins_bitwise_then_drops_and_regrows_a_replica(
    launch, tmp_path, committed_files
):
    """HSDP 2x2 as two simulated nodes of 2 (one replica each). Rank 1's training process is
    SIGKILLed, then rank 0's: each replacement loads its shards from its twin in the other
    replica, live and checksummed, the survivors keep their processes, torchrun restarts nothing,
    and a checkpoint committed after both equals an uninterrupted run's bit for bit. Then replica
    1's node freezes (SIGSTOP: its sockets stay open): after --silent-timeout the other replica
    trains on at data-parallel size 2 from its own shards, in place. The frozen node is killed and
    comes back: the job grows to 4 again, node 0 committing its step first. Then that node is
    SIGKILLed: the other replica goes on in place again. Every sample trains exactly once."""
    port, run_id = free_port(), f"hsdp-{uuid.uuid4().hex[:6]}"
    ckpt, ev, samples = str(tmp_path / "shared"), str(tmp_path / "ev.jsonl"), tmp_path / "samples"
    steps, every = 480, 40
    run = toy_args(ckpt, ev, max_steps=steps, every=every, step_time=0.04)[2:]  # ckpt: the recipe
    run += ["--parallel", "hsdp", "--sample-log", str(samples), "--keep-last", "20", *DATA]
    # One replacement a rank: its spare is then the last one started (the budget spent, none more).
    run += ["--replace-in-place", "--replace-wait", "3", "--no-local-checkpoint"]
    run += ["--max-replacements", "1"]
    run += ["--silent-timeout", "4", "--heartbeat-seconds", "1"]
    # The uninterrupted twin runs to the step compared, a checkpoint of both after the heals.
    ref_dir, compared = str(tmp_path / "ref"), 120
    ref_args = toy_args(ref_dir, str(tmp_path / "ref.jsonl"), max_steps=compared, every=every)
    ref_args += ["--parallel", "hsdp", "--mesh", "dp_replicate=2,dp_shard=2"]
    ref = launch(
        [*ref_args, "--task-option", "step_time=0", *DATA], nproc=4, name="ref", plain=True
    )

    def start_node(node: int, name: str):
        home = tmp_path / f"host{node}"
        home.mkdir(exist_ok=True)
        env = node_env(node, port, run_id, ckpt, NPROC="2", ELASTICTRAIN_LOG_LEVEL="INFO")
        return launch(run, script=TWO_NODES, env=env, cwd=str(home), name=name)

    def next_step(after: float) -> dict:
        return wait_for_event(
            ev, lambda e: e["event"] == Event.FIRST_STEP and e["time"] > after, 90, nodes[0]
        )

    committed = committed_files(ckpt)  # heals, a frozen and a lost node: write-once holds
    nodes = [start_node(0, "node0"), start_node(1, "node1")]
    first = wait_for_event(ev, lambda e: e["event"] == Event.CHECKPOINT, 120, nodes[0])
    _spares_ready(nodes, rank=1, n=1)
    # Mid-training, past the checkpoint's background writes: a kill beside them found ranks so
    # uneven that the others were inside the update gate (a fallback, not a heal: faults.md).
    wait_for_event(
        ev, lambda e: e["event"] == Event.PROGRESS and e["step"] > first["step"], 90, nodes[0]
    )
    nodes[0].kill_training_process(ev, rank=1, epoch=0)
    _epoch_began(ev, 1, nodes[0])
    _spares_ready(nodes, rank=0, n=1)
    nodes[0].kill_training_process(ev, rank=0, epoch=1)
    healed = _epoch_began(ev, 2, nodes[0])
    assert healed["step"] < compared, healed
    # A checkpoint of the healed job: compared with the uninterrupted run's at the same step.
    wait_for_event(
        ev, lambda e: e["event"] == Event.CHECKPOINT and e["step"] == compared, 90, nodes[0]
    )
    # Past that checkpoint's background write, as for the kill above: a freeze the moment it
    # committed found rank 0 a step behind its shard twin (steps held [120, 121]), and the job
    # rightly fell back to the durable copy instead of its memory (a CI run, 2026-12-06).
    wait_for_event(
        ev, lambda e: e["event"] == Event.PROGRESS and e["step"] > compared, 90, nodes[0]
    )
    # Node 1 is never the store's host (node 0's agent is): it is the one frozen and lost. The
    # rendezvous deals it ranks 0 and 1 or 2 and 3, anew at each round.
    frozen_ranks = _ranks_on(ev, nodes[1])
    t_freeze = time.time()
    nodes[1].signal_node(signal.SIGSTOP)  # a frozen host: every process stopped, sockets open
    thawed = next_step(t_freeze)
    nodes[1].kill()  # what a cluster does with a frozen host, in the end
    back = start_node(1, "node1-back")
    grown = wait_for_event(
        ev,
        lambda e: e["event"] == Event.START and e["time"] > thawed["time"] and e["world_size"] == 4,
        120,
        nodes[0],
    )
    next_step(grown["time"])
    lost_ranks = _ranks_on(ev, back)
    t_kill = time.time()
    back.kill()  # the node lost: its agent and every process under it, SIGKILL
    lost = next_step(t_kill)
    end = wait_for_event(ev, lambda e: e["event"] == Event.END, 120, nodes[0])
    # torchrun's agent would wait in its exit barrier for the lost node's (300 s); rank 0 arrived
    # for it (``cluster.agents``): the job exits 0 within 30 s of its last step.
    assert nodes[0].wait(60) == 0, nodes[0].log()[-3000:]
    assert time.time() - end["time"] < 30
    committed.check()
    assert ref.wait(120) == 0, ref.log()[-3000:]

    events = read_events(ev)
    starts = [e for e in events if e["event"] == Event.START]
    pids = [[pid for _, pid in e["processes"]] for e in starts]
    assert [e.get("replaced_ranks") for e in starts[:3]] == [None, [1], [0]], starts
    assert [e["restart_count"] for e in starts[:3]] == [0, 0, 0]
    # Survivors keep their processes; each replacement is a new one.
    assert [pids[1][r] for r in (0, 2, 3)] == [pids[0][r] for r in (0, 2, 3)], pids
    assert [pids[2][r] for r in (1, 2, 3)] == [pids[1][r] for r in (1, 2, 3)], pids
    assert pids[1][1] not in pids[0] and pids[2][0] not in pids[1]
    # Each replacement's shards came from its twin, live: nothing read from storage.
    heals = [_resume_after(events, s) for s in starts[1:3]]
    assert [(e.get("tier"), e.get("remote_bytes")) for e in heals] == [("live", 0), ("live", 0)]
    assert [e["served_by"] for e in heals] == [{"3": [1]}, {"2": [0]}], heals
    # Only the step in flight is redone.
    firsts = [e["step"] for e in events if e["event"] == Event.FIRST_STEP]
    assert [f - 1 for f in firsts[1:3]] == [e["step"] for e in heals]
    assert_bitwise_equal(final_state(ckpt, step=compared), final_state(ref_dir, step=compared))
    # A replica lost, twice (frozen, then SIGKILLed): the other went on at 2 ranks in place, from
    # its own shards, in its own processes, torchrun restarting nothing.
    for t, dropped, first in ((t_freeze, frozen_ranks, thawed), (t_kill, lost_ranks, lost)):
        before = [e for e in starts if e["time"] < t][-1]
        shrunk = next(e for e in starts if e["time"] > t)
        assert (shrunk["began"], shrunk["world_size"], shrunk["dropped_ranks"]) == (
            "shrunk in place",
            2,
            dropped,
        )
        kept = [pid for r, (_, pid) in enumerate(before["processes"]) if r not in dropped]
        assert [pid for _, pid in shrunk["processes"]] == kept
        assert shrunk["restart_count"] == before["restart_count"]
        resume = _resume_after(events, shrunk)
        assert (resume["tier"], resume["remote_bytes"], resume.get("served_by")) == (
            "live",
            0,
            None,
        )
        assert first["step"] == resume["step"] + 1
    # In between, the job grew back to 4 ranks: torchrun restarted every rank, node 0 having
    # committed its step first.
    alone = next(e for e in starts if e["time"] > t_freeze)
    assert not {p for _, p in grown["processes"]} & {p for _, p in alone["processes"]}
    assert [e for e in events if e["event"] == Event.PREEMPTED and t_freeze < e["time"]]
    assert events[-1]["event"] == Event.END and events[-1]["step"] == steps
    ledger = assert_exactly_once(
        read_sample_log(str(samples)), dataset_size=1024, batch_size=32, max_steps=steps
    )
    assert ledger["world_sizes"] == [2, 4], ledger
    print(
        f"\nreplica's node frozen -> its twin replica's next step: {thawed['time'] - t_freeze:.2f}s"
        f" (--silent-timeout 4); SIGKILLed -> {lost['time'] - t_kill:.2f}s (--replace-wait 3)"
    )


def _ranks_on(ev: str, job) -> list[int]:
    """The ranks of the newest epoch whose training processes run under ``job``'s agent."""
    start = [e for e in read_events(ev) if e["event"] == Event.START][-1]
    on_node = set(descendants(job.proc.pid))
    return [r for r, (_, pid) in enumerate(start["processes"]) if pid in on_node]


@pytest.mark.slow
def test_fsdp_rolls_back_in_memory_to_the_newest_whole_copy_skipping_a_corrupt_one(
    launch, tmp_path, committed_files
):
    """FSDP over 4 ranks, no replicas: a dead rank's shards are in no survivor's memory. Rank 2's
    training process is SIGKILLed: every rank, in its own process, rolls back to the newest step
    of which node memory holds every rank's copy, with no byte read from the durable tier. Then,
    with every process stopped, the newest whole copy is corrupted and rank 2 is killed again: the
    rollback skips it for the copy before (reported, never mixed with it). The final state equals
    an uninterrupted run's, which is what a resume at those steps must give (exact resume)."""
    # Both rollbacks are over by about step 125 on an idle host; the steps after are the margin
    # a loaded one needs while it waits for the spares.
    steps = 260
    run_dir, ev, shm = str(tmp_path / "run"), str(tmp_path / "ev.jsonl"), str(tmp_path / "shm")
    extra = ["--parallel", "fsdp", "--replace-in-place", "--replace-wait", "10"]
    extra += ["--max-replacements", "2"]  # rank 2's two deaths: no third spare for it
    extra += ["--local-checkpoint-dir", shm, "--local-every-steps", "10"]
    committed = committed_files(run_dir, shm)  # rollbacks in memory, buddies: write-once holds
    job = launch(
        toy_args(run_dir, ev, max_steps=steps, every=100, step_time=0.04, extra=tuple(extra)),
        nproc=4,
        name="fsdp-in-place",
        env=job_env(ELASTICTRAIN_LOG_LEVEL="INFO"),  # each spare says when it is ready
    )
    ref_dir = str(tmp_path / "ref")
    ref_args = toy_args(ref_dir, str(tmp_path / "ref.jsonl"), max_steps=steps, every=1000)
    ref = launch([*ref_args, "--parallel", "fsdp"], nproc=4, name="ref", plain=True)
    # Twelve processes start at once (the job's, its spares, the reference's): on a loaded 2-core
    # host that alone can take past 90 s, and nothing here times the start.
    _wait_whole_copy(shm, 30, job, timeout=180)
    wait_for_spares(job, rank=2, n=1)
    job.kill_training_process(ev, rank=2, epoch=0)
    _epoch_began(ev, 1, job)
    wait_for_spares(job, rank=2, n=2)
    # Past the durable checkpoint of step 100, with two whole copies newer than it.
    wait_for_event(ev, lambda e: e["event"] == Event.CHECKPOINT and e["step"] == 100, 90, job)
    _wait_whole_copy(shm, 130, job)
    # Every training process stopped: the copies on the tier cannot change under the test.
    training = [
        p for _, p in [e for e in read_events(ev) if e["event"] == Event.START][1]["processes"]
    ]
    for pid in training:
        os.kill(pid, signal.SIGSTOP)
    newest, older = _whole_copies(shm)[:2]
    _flip_a_byte(os.path.join(shm, "shards", "own-r00001"), newest, committed)
    job.kill_training_process(ev, rank=2, epoch=1)
    for pid in training:
        os.kill(pid, signal.SIGCONT)
    assert job.wait(180) == 0, job.log()[-3000:]
    committed.check()
    assert ref.wait(120) == 0, ref.log()[-3000:]

    events = read_events(ev)
    starts = [e for e in events if e["event"] == Event.START]
    pids = [[pid for _, pid in e["processes"]] for e in starts]
    assert [e.get("replaced_ranks") for e in starts] == [None, [2], [2]], starts
    assert [e["restart_count"] for e in starts] == [0, 0, 0]
    assert [pids[i][r] for i in (1, 2) for r in (0, 1, 3)] == [pids[0][r] for r in (0, 1, 3)] * 2
    rollbacks = [_resume_after(events, s) for s in starts[1:]]
    # From node memory, nothing from the durable tier, and only whole steps.
    assert [(e.get("tier"), e.get("remote_bytes")) for e in rollbacks] == [("fast", 0), ("fast", 0)]
    assert rollbacks[0]["step"] >= 30 and rollbacks[0]["step"] % 10 == 0  # a copy's step
    assert rollbacks[1]["step"] == older, (rollbacks[1], newest)
    corrupt = [e for e in events if e["event"] == Event.CORRUPT]
    assert [(e["step"], e["tier"]) for e in corrupt] == [(newest, "fast")], corrupt
    firsts = [e["step"] for e in events if e["event"] == Event.FIRST_STEP]
    assert [f - 1 for f in firsts[1:]] == [e["step"] for e in rollbacks]
    assert all(c.ok for c in storage.open_store(run_dir).list())
    assert events[-1]["event"] == Event.END and events[-1]["step"] == steps
    assert_bitwise_equal(final_state(run_dir), final_state(ref_dir))


def _wait_whole_copy(shm: str, step: int, job, timeout: float = 90) -> None:
    """Until every rank's own copy of some step >= ``step`` is committed on the tier."""
    deadline = time.monotonic() + timeout
    while not [s for s in _whole_copies(shm) if s >= step]:
        assert time.monotonic() < deadline and job.proc.poll() is None, job.log()[-3000:]
        time.sleep(0.05)


def _spares_ready(nodes: list, rank: int, n: int) -> None:
    """``wait_for_spares`` on whichever node holds ``rank``."""
    deadline = time.monotonic() + 120
    while sum(job.log().count(f"spare for rank {rank} ready") for job in nodes) < n:
        assert time.monotonic() < deadline, nodes[0].log()[-3000:]
        time.sleep(0.1)


def _whole_copies(shm: str) -> list[int]:
    """Steps of which every rank's own copy is committed on the tier, newest first."""
    root = os.path.join(shm, "shards")
    common = None
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        steps = set(storage.open_store(os.path.join(root, name)).committed_steps())
        common = steps if common is None else common & steps
    return sorted(common or (), reverse=True)


def _flip_a_byte(folder: str, step: int, committed) -> None:
    """Corrupt the shard file of ``folder``'s copy of ``step`` (its checksums will not match),
    telling the write-once checker first: this change is the test's own."""
    step_dir = os.path.join(folder, step_dir_name(step))
    name = next(n for n in sorted(os.listdir(step_dir)) if n.startswith("shard-"))
    committed.damaged(os.path.join(step_dir, name))
    with open(os.path.join(step_dir, name), "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))

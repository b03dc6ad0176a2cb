"""--replace-in-place: a SIGKILLed training process is replaced by its rank's spare while the
other ranks keep their processes and their state; torchrun never sees a failure."""

from __future__ import annotations

import signal
import time
import uuid

import pytest

import storage
from elastictrain.observe.events import Event, read_events, read_sample_log
from tests.helpers.committed_files import CommittedFiles
from tests.helpers.elastic import assert_exactly_once
from tests.helpers.kill_during_persist import _wait_half_written
from tests.helpers.launcher import (
    TWO_NODES,
    assert_bitwise_equal,
    final_state,
    job_env,
    node_env,
    off_node_agent,
    store_server,
    toy_args,
    wait_for_event,
    wait_for_spares,
)
from tests.helpers.net import free_port
from tests.helpers.restart_loop import wait_for_count

STEPS = 220
# ~40 MB of trained state: a persist to aim at. Trained, not frozen (``frozen_mb``): the steps
# compute slows the job as the machine's load slows the spares it waits for, so the four kills
# land before the job's last step; paced by a sleep alone, a loaded run finished first.
TOY = ("hidden=1024", "layers=5", "batch_size=32")
TOY_ARGS = tuple(a for opt in TOY for a in ("--task-option", opt))


def _wait_epoch_began(events: str, n: int, job) -> None:
    """Until membership epoch ``n`` (0-based) completed its first step."""
    wait_for_count(events, Event.FIRST_STEP, n + 1, 90, job)


@pytest.mark.slow
# Six kills, each waiting for its rank's spare to be ready (torch imported, DDP primed): 120 s
# alone, 149 and 252 s in two full runs with the heaviest tests beside it. The suite's 300 s
# would end it while it still makes progress; a hang still ends it.
@pytest.mark.timeout(420)
def test_killed_training_processes_are_replaced_in_place_bitwise(launch, tmp_path):
    """At 3 ranks (past two, DDP's bucket order is gloo's summation order), rank 1's training
    process SIGKILLed mid-step, then rank 0's while its background persist is half-written, then
    rank 0's while it writes its node's local copy: the survivors keep their pids, torchrun
    restarts nothing, and no torn copy is ever committed. Then all three, the others during the
    first's recovery: the epoch falls back to the checkpoints. The final state equals an
    uninterrupted run's."""
    ref_dir = str(tmp_path / "ref")
    ref_args = toy_args(ref_dir, str(tmp_path / "ref.jsonl"), max_steps=STEPS, every=1000)
    ref = launch(
        [*ref_args, "--task-option", "step_time=0", *TOY_ARGS], nproc=3, name="ref", plain=True
    )
    run_dir, ev, shm = str(tmp_path / "run"), str(tmp_path / "run.jsonl"), str(tmp_path / "shm")
    # A replacement whose spare is still importing (this machine is loaded) is waited for: the
    # default --replace-wait (0.5 s) would drop its rank and restart (the lost-node test below).
    extra = ["--replace-in-place", "--replace-wait", "10", "--keep-last", "2", *TOY_ARGS]
    # The triple kill lands inside a new epoch's handshake (6 runs of 6): its fallback, torchrun's
    # restart, waits --replace-timeout first. A recovery here takes under 1 s (34 MB of state)
    # after up to --replace-wait for the replacement.
    extra += ["--replace-timeout", "30"]
    extra += ["--local-checkpoint-dir", shm, "--local-every-steps", "5"]
    # In-place epochs, a kill mid-persist and mid-copy, retention (--keep-last 2): write-once holds.
    with CommittedFiles(run_dir, shm) as committed:
        job = launch(
            toy_args(run_dir, ev, max_steps=STEPS, every=20, step_time=0.05, extra=tuple(extra)),
            max_restarts=1,  # the fallback, if the triple kill lands inside the handshake
            nproc=3,
            name="in-place",
            env=job_env(ELASTICTRAIN_LOG_LEVEL="INFO"),  # every rank's spare says when it is ready
        )
        _wait_epoch_began(ev, 0, job)
        wait_for_spares(job, rank=1, n=1)
        killed = [job.kill_training_process(ev, rank=1, epoch=0)]
        _wait_epoch_began(ev, 1, job)
        wait_for_spares(job, rank=0, n=1)
        torn = _wait_half_written(run_dir, 60, job)
        killed.append(job.kill_training_process(ev, rank=0, epoch=1))
        _wait_epoch_began(ev, 2, job)
        wait_for_spares(job, rank=0, n=2)
        torn_copy = _wait_half_written(shm, 60, job)
        killed.append(job.kill_training_process(ev, rank=0, epoch=2))
        _wait_epoch_began(ev, 3, job)
        copies = storage.open_store(shm)
        assert all(c.ok for c in copies.list()), copies.list()  # every committed copy verifies
        print(f"\nkilled writing local copy {torn_copy}: committed {copies.committed_steps()}")
        # Every process, 50 ms apart: the later ones die while the first's recovery runs, so no
        # survivor holds the state and the epoch resumes from the checkpoints.
        t3 = read_events(ev)[-1]["time"]
        newest = wait_for_event(
            ev, lambda e: e["event"] == Event.CHECKPOINT and e["time"] > t3, 90, job
        )
        wait_for_spares(job, rank=0, n=3)
        wait_for_spares(job, rank=1, n=2)
        wait_for_spares(job, rank=2, n=1)
        for rank in (1, 0, 2):
            job.kill_training_process(ev, rank=rank, epoch=3)
            time.sleep(0.05)
        assert job.wait(180) == 0, job.log()[-3000:]
    committed.check()
    assert ref.wait(120) == 0, ref.log()[-3000:]

    events = read_events(ev)
    starts = [e for e in events if e["event"] == Event.START]
    pids = [[pid for _, pid in e["processes"]] for e in starts]
    assert [e["restart_count"] for e in starts[:4]] == [0, 0, 0, 0], starts
    assert [e.get("replaced_ranks") for e in starts[:4]] == [None, [1], [0], [0]]
    # Survivors keep their processes; each replacement is a new one.
    assert pids[1][0] == pids[0][0] and pids[2][1] == pids[1][1] == pids[3][1], pids
    assert pids[1][1] not in pids[0] and pids[2][0] not in pids[1] and pids[3][0] not in pids[2]
    assert killed == [pids[0][1], pids[1][0], pids[2][0]]
    resumes = [e for e in events if e["event"] == Event.RESUME]
    assert [e.get("tier") for e in resumes[1:4]] == ["live", "live", "live"]
    assert all(e["remote_bytes"] == 0 for e in resumes[1:4])
    # The triple kill: all replaced in place, or (a death inside the new epoch's handshake)
    # torchrun's restart; either way no survivor holds the state, which comes from the checkpoints.
    last = starts[-1]
    assert last.get("began") == "replaced, from the checkpoints" or last["restart_count"] == 1
    assert resumes[-1]["tier"] in ("local", "durable") and resumes[-1]["step"] >= newest["step"]
    # Only the step in flight is redone: each epoch resumes at the newest step a survivor held.
    progress = [e["step"] for e in events if e["event"] == Event.FIRST_STEP]
    assert [p - 1 for p in progress[1:4]] == [e["step"] for e in resumes[1:4]]
    assert torn not in storage.open_store(run_dir).committed_steps()
    assert events[-1]["event"] == Event.END and events[-1]["step"] == STEPS
    # What each epoch began from, for a failure below (seen once in CI, not reproduced alone).
    print([(e["event"], e.get("began"), e.get("step"), e.get("tier")) for e in starts + resumes])
    faults = [e for e in events if e["event"] in (Event.SKIP, Event.ROLLBACK, Event.REPLICAS)]
    assert not faults, faults  # a clean run: no numerical fault is found in it
    assert_bitwise_equal(final_state(run_dir), final_state(ref_dir))


@pytest.mark.slow  # 35 s in the quick tier (2026-12-07): over its 20 s line
def test_a_death_that_recurs_at_one_step_ends_the_job_with_a_clear_error(launch, tmp_path):
    """Rank 1 dies every time it trains step 30. Replaced once, it dies there again: every rank
    stops with an error that says so, instead of replacing until a budget runs out. (That
    torchrun's restart then stops at once too, the verdict kept in its store, is
    test_membership's: a restart here cost two more processes per rank.)"""
    ev = str(tmp_path / "ev.jsonl")
    crash = ("crash_rank=1", "crash_step=30")
    extra = ["--replace-in-place", "--task", "tests.helpers.recurring_crash:make_task"]
    extra += [a for opt in crash for a in ("--task-option", opt)]
    # The second replacement's spare starts with the first, a step before rank 1 dies again: on a
    # loaded host it may still be importing then (seen: more than 10 s with five xdist workers),
    # and must be waited for to hear the verdict too. The wait ends as soon as it is back.
    extra += ["--replace-wait", "45"]
    job = launch(toy_args(str(tmp_path / "c"), ev, step_time=0, extra=tuple(extra)), max_restarts=0)
    assert job.wait(120) != 0
    log = job.log()
    assert log.count("died twice at step 30") >= 2, log[-3000:]  # both ranks
    starts = [e for e in read_events(ev) if e["event"] == Event.START]
    # The first epoch and its one replacement; the second replacement stops before training.
    assert [e["restart_count"] for e in starts] == [0, 0], starts
    assert "RecurringFailureError" in log


@pytest.mark.slow
def test_a_pause_is_not_evicted_and_a_persistent_straggler_node_is_and_every_sample_trains_once(
    launch, tmp_path
):
    """--straggler-action evict, two simulated nodes of one rank (torchrun --nnodes=1:2). First
    node 1 is SIGSTOPped for 10 s, then both nodes for 10 s (a job-wide stall): a short pause is
    not a straggler and a slowdown of every rank is not one, so nobody is named. Then, from step
    800, node 1's rank does 3x the others' work before each step's sync: named after 3 reports,
    then evicted. Node 1's rank exits 9 and its supervisor stops its agent; node 0's rank keeps
    its process and state and trains on alone from the step of the decision (nothing redone,
    nothing read from storage), torchrun restarting nothing, every sample trains exactly once,
    and node 0's torchrun exits 0 within 30 s of the last step. (Seen failing with each rank's
    window judged by its mean instead of its median: the first pause evicted node 1; with the
    survivors not told the evicted ranks are gone: they waited --replace-wait for them as for a
    lost node; with the supervisor passing exit 9 on, torchrun restarted the group.)"""
    port, run_id = free_port(), f"evict-{uuid.uuid4().hex[:6]}"
    ckpt, ev, samples = str(tmp_path / "shared"), str(tmp_path / "ev.jsonl"), tmp_path / "samples"
    steps, slow_from, data = 1100, 800, ("dataset_size=1024", "batch_size=32")
    run = toy_args(ckpt, ev, max_steps=steps, every=50, step_time=0.03)[2:]  # ckpt: the recipe
    run += [a for opt in data for a in ("--task-option", opt)]
    run += ["--log-every-seconds", "1", "--sample-log", str(samples)]
    run += ["--replace-in-place", "--replace-wait", "30", "--straggler-action", "evict"]
    run += ["--max-replacements", "0"]  # no process spares: a node leaves, none is replaced
    nodes = []
    for node in (0, 1):
        home = tmp_path / f"host{node}"
        home.mkdir()
        env = node_env(node, port, run_id, ckpt)
        # Node 1 slow (node 0's agent serves the job's store: never evicted); which rank it gets
        # is the rendezvous's choice.
        slow = ["--task-option", "step_factor=3", "--task-option", f"slow_from_step={slow_from}"]
        nodes.append(
            launch(
                run + (slow if node == 1 else []),
                script=TWO_NODES,
                env=env,
                cwd=str(home),
                name=f"node{node}",
            )
        )
    for paused in ([nodes[1]], nodes):  # one node, then the whole job: neither is a straggler
        wait_for_event(
            ev, lambda e: e["event"] == Event.PROGRESS and e["step"] >= 60, 150, nodes[0]
        )
        for node in paused:
            node.signal_node(signal.SIGSTOP)
        time.sleep(10)
        for node in paused:
            node.signal_node(signal.SIGCONT)
        thawed = time.time()
        # Four reports after it: what a straggler needs to be named (SLOW_REPORTS, and one more).
        report = wait_for_event(
            ev, lambda e, t=thawed: e["event"] == Event.PROGRESS and e["time"] > t + 4, 60, nodes[0]
        )
        assert report["step"] < slow_from and report["world_size"] == 2, report
    early = [e for e in read_events(ev) if e["event"] in (Event.STRAGGLER, Event.EVICTION)]
    assert not early, early
    assert nodes[1].wait(120) != 0, nodes[1].log()[-3000:]  # torchrun exits 1 on its SIGTERM
    end = wait_for_event(ev, lambda e: e["event"] == Event.END, 120, nodes[0])
    # torchrun's agents wait for each other once their workers finish (300 s): rank 0 arrived
    # for node 1's agent (``cluster.agents``), so node 0's exits now, and exits 0. (Seen failing
    # without it: still waiting 60 s later.)
    assert nodes[0].wait(60) == 0, nodes[0].log()[-3000:]
    assert time.time() - end["time"] < 30

    events = read_events(ev)
    starts = [e for e in events if e["event"] == Event.START]
    (host,) = starts[0]["store_nodes"]  # torchrun's node rank of the recipe's node 0
    (slow,) = set(starts[0]["nodes"]) - {host}
    (slow_rank,) = [r for r, n in enumerate(starts[0]["nodes"]) if n == slow]
    (evicted,) = [e for e in events if e["event"] == Event.EVICTION]
    assert (evicted["evicted"], evicted["node"], evicted["ranks"]) == (True, slow, [slow_rank])
    assert evicted["evidence"]["rank"] == slow_rank and evicted["evidence"]["ratio"] > 2, evicted
    named = [e for e in events if e["event"] == Event.STRAGGLER]
    assert [(e["rank"], e["step"]) for e in named] == [(slow_rank, evicted["step"])], named
    assert [(e["world_size"], e["nodes"], e["restart_count"]) for e in starts] == [
        (2, [0, 1], 0),  # rank r on node r: one rank a node
        (1, [host], 0),
    ], starts
    assert (starts[1]["began"], starts[1]["dropped_ranks"]) == ("shrunk in place", [slow_rank])
    kept = starts[0]["processes"][1 - slow_rank]
    assert starts[1]["processes"][0] == kept  # the survivor's own process
    # --replace-wait 30: had the survivor waited for the evicted rank as for a lost node, this
    # epoch would have begun 30 s after the decision.
    assert starts[1]["time"] - evicted["time"] < 10, (starts[1], evicted)
    resume = next(e for e in events if e["event"] == Event.RESUME and e["time"] > evicted["time"])
    assert (resume["tier"], resume["remote_bytes"], resume["step"]) == ("live", 0, evicted["step"])
    log = nodes[1].log()
    assert f"FAILED (exit 9): NodeEvictedError: node {slow} (ranks [{slow_rank}]" in log
    assert "this node was evicted; stopping its torchrun agent" in log
    ledger = assert_exactly_once(
        read_sample_log(str(samples)), dataset_size=1024, batch_size=32, max_steps=steps
    )
    assert ledger["world_sizes"] == [1, 2], ledger


@pytest.mark.slow
def test_an_hsdp_straggler_node_is_evicted_and_the_other_replica_trains_on_from_its_own_shards(
    launch, tmp_path
):
    """--straggler-action evict under --parallel hsdp, two simulated nodes of two ranks (a
    replica per node), node 1's ranks 3x slower from the start: named, and node 1 (both its
    ranks) evicted. Node 0's replica trains on at two ranks from its own shards (``live``, no
    byte read from storage), from the step of the decision, torchrun restarting nothing; the
    ledger is exactly once across world sizes 4 and 2. (Seen failing with the evicted node's
    ranks not raising ``NodeEvictedError``: they took the others' leaving for a death and waited
    for a replacement, and node 1's torchrun never exited.)"""
    port, run_id = free_port(), f"evict-hsdp-{uuid.uuid4().hex[:6]}"
    ckpt, ev, samples = str(tmp_path / "shared"), str(tmp_path / "ev.jsonl"), tmp_path / "samples"
    steps, data = 200, ("dataset_size=1024", "batch_size=32")
    run = toy_args(ckpt, ev, max_steps=steps, every=50, step_time=0.03)[2:]
    run += [a for opt in data for a in ("--task-option", opt)]
    run += ["--log-every-seconds", "1", "--sample-log", str(samples), "--parallel", "hsdp"]
    run += ["--replace-in-place", "--max-replacements", "0", "--straggler-action", "evict"]
    nodes = []
    for node in (0, 1):
        home = tmp_path / f"host{node}"
        home.mkdir()
        env = node_env(node, port, run_id, ckpt, NPROC="2")
        slow = ["--task-option", "step_factor=3"] if node == 1 else []
        nodes.append(
            launch(run + slow, script=TWO_NODES, env=env, cwd=str(home), name=f"node{node}")
        )
    assert nodes[1].wait(150) != 0, nodes[1].log()[-3000:]  # torchrun exits 1 on its SIGTERM
    assert nodes[0].wait(120) == 0, nodes[0].log()[-3000:]
    events = read_events(ev)
    (evicted,) = [e for e in events if e["event"] == Event.EVICTION]
    assert evicted["evicted"] and len(evicted["ranks"]) == 2, evicted
    starts = [e for e in events if e["event"] == Event.START]
    assert [(e["world_size"], e["restart_count"]) for e in starts] == [(4, 0), (2, 0)], starts
    resume = next(e for e in events if e["event"] == Event.RESUME and e["time"] > evicted["time"])
    assert (resume["tier"], resume["remote_bytes"], resume["step"]) == ("live", 0, evicted["step"])
    ledger = assert_exactly_once(
        read_sample_log(str(samples)), dataset_size=1024, batch_size=32, max_steps=steps
    )
    assert ledger["world_sizes"] == [2, 4], ledger


@pytest.mark.slow
def test_spare_nodes_take_a_straggler_nodes_and_then_a_killed_nodes_ranks_bitwise(launch, tmp_path):
    """--spare-nodes 2 --straggler-action replace, four simulated nodes of one rank (the
    rendezvous store off them): torchrun ranks 0 and 1 train, 2 and 3 stand by. Rank 1 does 3x
    the others' work before each step's sync: named, then its node's ranks handed to spare rank
    2. Then rank 0's node is SIGKILLed: spare rank 3 takes its place. Each time the world size
    stays 2, the spare trains in the lost rank's position with the state of a survivor, torchrun
    restarts nothing, and the final state is bitwise that of an uninterrupted 2-rank run; the
    nodes still in the job exit 0 within 30 s of the last step. (Seen failing with the decider's
    call of a spare left out: the job shrank to one rank, and to none.)"""
    steps, port, run_id = 400, free_port(), f"spares-{uuid.uuid4().hex[:6]}"
    ckpt, ev, ref_dir = str(tmp_path / "shared"), str(tmp_path / "ev.jsonl"), str(tmp_path / "ref")
    ref_args = toy_args(ref_dir, str(tmp_path / "ref.jsonl"), max_steps=steps, every=1000)
    ref = launch([*ref_args, "--task-option", "step_time=0"], nproc=2, name="ref", plain=True)
    run = toy_args(ckpt, ev, max_steps=steps, every=100, step_time=0.03)[2:]
    run += ["--task-option", "slow_rank=1", "--task-option", "slow_factor=3"]
    run += ["--log-every-seconds", "1", "--replace-in-place", "--max-replacements", "0"]
    run += ["--spare-nodes", "2", "--straggler-action", "replace"]
    env = job_env()
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # torch's default: the shared store
    with store_server(port):
        nodes = []
        for node in range(4):
            home = tmp_path / f"host{node}"
            home.mkdir()
            args = ["--checkpoint-dir", ckpt, *run]
            targs = off_node_agent("4", port, run_id)
            nodes.append(launch(args, torchrun_args=targs, env=env, cwd=str(home), name=f"n{node}"))
        decided = wait_for_event(ev, lambda e: e["event"] == Event.EVICTION, 150)
        took = wait_for_event(
            ev, lambda e: e["event"] == Event.START and e["time"] > decided["time"], 60
        )
        assert took.get("took_over") == [[1, 2]], took  # not shrunk: a spare took its place
        wait_for_event(
            ev, lambda e: e["event"] == Event.FIRST_STEP and e["time"] > took["time"], 60
        )
        (killed,) = [n for n in nodes if 0 in n.workers()]
        t_kill = time.time()
        killed.kill()
        end = wait_for_event(ev, lambda e: e["event"] == Event.END, 120)
        evicted = next(n for n in nodes if n is not killed and n.proc.poll() is not None)
        assert evicted.wait(1) != 0  # torchrun exits 1 on the SIGTERM its evicted rank sent
        for node in nodes:
            if node not in (killed, evicted):
                assert node.wait(60) == 0, node.log()[-3000:]
        assert time.time() - end["time"] < 30
    assert ref.wait(120) == 0, ref.log()[-3000:]

    events = read_events(ev)
    (decision,) = [e for e in events if e["event"] == Event.EVICTION]
    assert (decision["evicted"], decision["action"], decision["ranks"]) == (True, "replace", [1])
    starts = [e for e in events if e["event"] == Event.START]
    assert [(e["world_size"], e["restart_count"], e.get("took_over")) for e in starts] == [
        (2, 0, None),
        (2, 0, [[1, 2]]),  # spare rank 2 in the straggler's place: its position, its data
        (2, 0, [[0, 3]]),
    ], starts
    assert (
        starts[2]["time"] > t_kill and starts[2]["began"] == "taken over by a spare node in place"
    )
    # The survivors keep their processes: rank 0's through the first takeover, rank 2's after.
    assert starts[1]["processes"][0] == starts[0]["processes"][0]
    assert starts[2]["processes"][1] == starts[1]["processes"][1]
    resumes = [e for e in events if e["event"] == Event.RESUME]
    assert [e.get("tier") for e in resumes[1:]] == ["live", "live"], resumes
    print(f"\nspare took the killed node's ranks: training again {starts[2]['time'] - t_kill:.2f}s")
    assert_bitwise_equal(final_state(ckpt), final_state(ref_dir))

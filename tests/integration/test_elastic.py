"""Real torchrun agents as nodes: an FSDP job loses one and reshards, and losing the rendezvous
host ends the job and a relaunch resumes. (Node loss and rejoin through the two-node recipe, with
the ledger and the weights: test_multinode.py.)"""

from __future__ import annotations

import time
import uuid

import pytest

from elastictrain.checkpoint.api import Tier
from elastictrain.observe.events import Event, read_events, read_sample_log
from elastictrain.tools.chaos import descendants
from tests.helpers.elastic import assert_exactly_once, node_args
from tests.helpers.launcher import job_env, wait_for_event, wait_for_fast_copies
from tests.helpers.net import free_port

DATASET, BATCH, STEPS = 2048, 64, 640  # 32 steps per epoch, 20 epochs


def app_args(tmp_path, name: str, step_time: float = 0.03, extra=(), steps=STEPS) -> list[str]:
    return [
        "--checkpoint-dir",
        str(tmp_path / f"{name}-ckpt"),
        "--event-log",
        str(tmp_path / f"{name}.jsonl"),
        "--sample-log",
        str(tmp_path / f"{name}-samples"),
        "--max-steps",
        str(steps),
        "--checkpoint-every-steps",
        "40",
        "--log-every-seconds",
        "1",
        "--task-option",
        f"dataset_size={DATASET}",
        "--task-option",
        f"batch_size={BATCH}",
        "--task-option",
        f"step_time={step_time}",
        *extra,
    ]


@pytest.mark.slow
def test_fsdp_node_loss_reshards_and_trains_every_sample_once(launch, tmp_path, committed_files):
    """FSDP under c10d, 2 nodes of 2 ranks: one node is lost; the survivor reshards from 4 ranks
    to 2 out of the fast tier (its own shards, and the lost node's, which its ranks kept as their
    buddies') and finishes, reading no state from the durable tier; the ledger shows every sample
    trained exactly once."""
    steps = 320
    port, run_id = free_port(), f"run-{uuid.uuid4().hex[:8]}"
    env = job_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    ev = str(tmp_path / "fsdp.jsonl")
    args = app_args(tmp_path, "fsdp", 0.03, ("--parallel", "fsdp"), steps)

    def on(node: str) -> list[str]:  # each node's tier in its own folder, as on real hosts
        return [*args, "--local-checkpoint-dir", str(tmp_path / node), "--local-every-steps", "5"]

    def node(host: bool) -> list[str]:
        return node_args(port, run_id, is_host=host, nproc=2)

    committed = committed_files(tmp_path)  # both tiers, buddies' copies too: write-once holds
    host = launch(on("a"), torchrun_args=node(True), env=env, name="a")
    wait_for_event(ev, lambda e: e["event"] == Event.START, 60, host)  # the store is up
    node_b = launch(on("b"), torchrun_args=node(False), env=env, name="b")
    # A checkpoint committed at world size 4, so the survivor has sharded state to reshard.
    pair = wait_for_event(
        ev, lambda e: e["event"] == Event.START and e["world_size"] == 4, 120, host
    )
    durable = wait_for_event(
        ev, lambda e: e["event"] == Event.CHECKPOINT and e["time"] > pair["time"], 120, host
    )
    # Node a holds a step at least that new whole: its ranks' own copies and node b's ranks' (its
    # buddies'), each written and sent in the background at its own pace. The rendezvous deals
    # node a ranks 0 and 1 or ranks 2 and 3 (a CI run found the second).
    on_a = set(descendants(host.proc.pid))
    mine = [r for r, (_, pid) in enumerate(pair["processes"]) if pid in on_a]
    copies = [f"{'own' if r in mine else 'peer'}-r{r:05d}" for r in range(4)]
    ckpt = str(tmp_path / "fsdp-ckpt")
    wait_for_fast_copies(str(tmp_path / "a"), copies, ckpt, durable["step"], 120, host)
    node_b.kill()  # SIGKILL the agent and every descendant: a lost node
    assert host.wait(240) == 0, host.log()[-3000:]
    committed.check()
    events = read_events(ev)
    shrunk = [e for e in events if e["event"] == Event.MEMBERSHIP and e["new_world_size"] == 2]
    assert shrunk and shrunk[-1]["old_world_size"] == 4, events
    # The resume that announced the change (its event comes just before the membership one).
    alone = [e for e in events[: events.index(shrunk[-1])] if e["event"] == Event.RESUME][-1]
    assert (alone["tier"], alone["remote_bytes"], alone["world_size"]) == (Tier.FAST, 0, 2), alone
    assert sorted(r for ranks in alone["served_by"].values() for r in ranks) == [0, 1, 2, 3]
    assert events[-1]["event"] == Event.END and events[-1]["step"] == steps
    ledger = assert_exactly_once(
        read_sample_log(str(tmp_path / "fsdp-samples")),
        dataset_size=DATASET,
        batch_size=BATCH,
        max_steps=steps,
    )
    assert ledger["world_sizes"] == [2, 4], ledger


@pytest.mark.slow
def test_losing_the_rendezvous_host_ends_the_job_and_a_relaunch_resumes(launch, tmp_path):
    """torchrun's c10d store lives in the host agent: when that node dies, the survivors cannot
    re-rendezvous. They exit non-zero, and a relaunch (the scheduler's job) resumes from the last
    committed checkpoint. See README "Losing the rendezvous host"."""
    env = job_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    ev = str(tmp_path / "elastic.jsonl")
    args = app_args(tmp_path, "elastic")
    port, run_id = free_port(), f"run-{uuid.uuid4().hex[:8]}"
    host = launch(args, torchrun_args=node_args(port, run_id, is_host=True), env=env, name="host")
    time.sleep(1.0)
    other = launch(
        args, torchrun_args=node_args(port, run_id, is_host=False), env=env, name="other"
    )
    wait_for_event(ev, lambda e: e["event"] == Event.CHECKPOINT and e["step"] >= 80, 120, host)
    t_loss = time.time()
    host.kill()
    assert other.wait(150) != 0
    survivor_exit_s = time.time() - t_loss
    assert survivor_exit_s < 30, survivor_exit_s  # the README: "within seconds", not a timeout
    last = max(e["step"] for e in read_events(ev) if e["event"] == Event.CHECKPOINT)
    resumed_before = sum(e["event"] == Event.RESUME for e in read_events(ev))

    port, run_id = free_port(), f"run-{uuid.uuid4().hex[:8]}"  # the relaunch: a fresh rendezvous
    a = launch(
        args, torchrun_args=node_args(port, run_id, is_host=True), env=env, name="relaunch-a"
    )
    time.sleep(1.0)
    b = launch(
        args, torchrun_args=node_args(port, run_id, is_host=False), env=env, name="relaunch-b"
    )
    assert a.wait(180) == 0 and b.wait(60) == 0, a.log()[-3000:]
    # The relaunch's first resume is from the newest checkpoint. (If agent b arrives after a's
    # first rendezvous closed, a starts alone and b's join adds a membership change: later resumes.)
    relaunched = [e for e in read_events(ev) if e["event"] == Event.RESUME][resumed_before:]
    # The newest copy on either tier: the last durable checkpoint, or a newer local copy of the
    # node that survived (the local tier's interval depends on load).
    first = relaunched[0]
    assert not first["fresh"] and first["step"] >= last, relaunched
    assert (first["step"] if first.get("tier") != Tier.LOCAL else first["durable_step"]) == last
    assert_exactly_once(
        read_sample_log(str(tmp_path / "elastic-samples")),
        dataset_size=DATASET,
        batch_size=BATCH,
        max_steps=STEPS,
    )
    print(
        f"\nrendezvous host lost: survivor exited after {survivor_exit_s:.1f}s; relaunch resumed from step {last}"
    )

"""The runner's 2-D meshes (``--mesh``), through real torchrun jobs on CPU/gloo: (dp 2, tp 2) and
HSDP 2x2 resume bitwise after a kill; and the exactly-once ledger holds when the data-parallel
size shrinks (tp fixed; a replica lost). That a tensor-parallel group trains what one rank trains
is test_layouts_agree.py's."""

from __future__ import annotations

import json
import os

import pytest

from elastictrain import toy
from elastictrain.checkpoint.api import Tier
from elastictrain.observe.events import Event, read_events, read_sample_log
from storage.manifest import parse_step_dir
from tests.helpers.committed_files import tier_folder
from tests.helpers.elastic import assert_exactly_once
from tests.helpers.launcher import (
    assert_bitwise_equal,
    final_state,
    toy_args,
    wait_for_event,
    wait_for_fast_copies,
)
from tests.helpers.layout_task import train_one_rank
from tests.helpers.paths import flip_a_byte

TASK = ("--task", "tests.helpers.tp_task:make_task")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mesh", "kill", "shrunk", "then"),
    [
        # (dp 2, tp 2) -> (dp 1, tp 2): half the data-parallel ranks go, tp stays; then the
        # same checkpoint moves to (dp 4, tp 1), FSDP over 4.
        ("dp_shard=2,tp=2", 3, "tp=2", "dp_shard=4"),
        # HSDP 2x2 -> FSDP 2: a replica (a node) lost. Each shard was written by one replica.
        ("dp_replicate=2,dp_shard=2", 2, "dp_shard=2", None),
    ],
    ids=["dp2-tp2", "hsdp-2x2"],
)
def test_a_2d_mesh_resumes_bitwise_after_a_kill_and_exactly_once_at_a_smaller_dp_size(
    launch, tmp_path, mesh, kill, shrunk, then
):
    layout = ("--parallel", "fsdp", "--mesh", mesh)
    ref_dir, run_dir, samples = (str(tmp_path / n) for n in ("ref", "run", "samples"))
    ev, ref_ev = str(tmp_path / "run.jsonl"), str(tmp_path / "ref.jsonl")

    def reference(steps: int):
        args = toy_args(ref_dir, ref_ev, max_steps=steps, every=20, extra=(*TASK, *layout))
        return launch(args, nproc=4, max_restarts=0, name=f"ref-{steps}", plain=True)

    # Before the launches: its first call imports the checkpoint package, seconds on a loaded
    # host, and a kill aimed at step 40 must not wait on that (retention deletes step 40 at 100).
    fast_tier = tier_folder(run_dir)
    ref = reference(120)
    # (dp 2, tp 2) resumes from the fast tier, which serves the 2-D layouts too; HSDP from the
    # durable tier, as the same mesh, its replicas sharing the reads.
    replicated = "dp_replicate" in mesh
    tier = ["--no-local-checkpoint"] if replicated else ["--local-every-steps", "5"]
    args = toy_args(run_dir, ev, max_steps=120, every=20, extra=(*TASK, *layout))
    job = launch([*args, "--sample-log", samples, *tier], nproc=4, name="run")
    durable = wait_for_event(
        ev, lambda e: e["event"] == Event.CHECKPOINT and e["step"] >= 40, 120, job
    )
    if not replicated:  # every rank's copy of that step is in node memory too (a CI run killed
        # rank 3 while it wrote its copy of 40: the resume then took the durable tier's 40)
        own = [f"own-r{r:05d}" for r in range(4)]
        wait_for_fast_copies(fast_tier, own, run_dir, durable["step"], 60, job)
    job.kill_worker(kill)
    assert job.wait(240) == 0, job.log()[-3000:]
    assert ref.wait(240) == 0, ref.log()[-3000:]
    # The uninterrupted 2-D run trains what one process trains (test_layouts_agree.py's check,
    # here on the toy under SGD with momentum, at no launch of its own).
    one_rank, _, _ = train_one_rank(120, options={"step_time": "0"}, make=toy.make_task)
    uninterrupted = final_state(ref_dir)["model"]
    for key, want in one_rank.items():
        worst = float((uninterrupted[key] - want).abs().max())
        assert worst <= 1e-5 * float(want.abs().max()), (key, worst)
    resumes = [e for e in read_events(ev) if e["event"] == Event.RESUME and not e["fresh"]]
    assert resumes and resumes[0]["step"] >= 40, resumes
    if replicated:
        _assert_replicas_shared_the_durable_read(run_dir, resumes[0])
    else:
        assert (resumes[0]["tier"], resumes[0]["remote_bytes"]) == (Tier.FAST, 0), resumes[0]
    assert_bitwise_equal(final_state(run_dir), final_state(ref_dir))
    # Its index is one line per tensor (the grid of its placements), whatever W: format 3.
    index = _index(run_dir, 120)
    assert index["format"] == "elastictrain-sharded/3"
    assert all("grid" in t and "chunks" not in t for t in index["tensors"].values())
    # A flipped byte in the newest checkpoint's shard: the smaller run falls back to step 100.
    flip_a_byte(os.path.join(run_dir, _step_dir(run_dir, 120), _first_shard(run_dir, 120)))
    more = toy_args(
        run_dir, ev, max_steps=160, every=20, extra=(*TASK, "--parallel", "fsdp", "--mesh", shrunk)
    )
    job = launch(
        [*more, "--sample-log", samples], nproc=2, max_restarts=0, name="smaller", plain=True
    )
    assert job.wait(180) == 0, job.log()[-3000:]
    events = read_events(ev)
    assert [e["step"] for e in events if e["event"] == Event.CORRUPT] == [120]
    assert [e for e in events if e["event"] == Event.RESUME][-1]["step"] == 100
    steps, sizes = 160, ([1, 2] if "tp" in mesh else [2, 4])
    if then is not None:
        last = toy_args(
            run_dir,
            ev,
            max_steps=200,
            every=20,
            extra=(*TASK, "--parallel", "fsdp", "--mesh", then),
        )
        job = launch(
            [*last, "--sample-log", samples], nproc=4, max_restarts=0, name="then", plain=True
        )
        assert job.wait(180) == 0, job.log()[-3000:]
        steps, sizes = 200, [1, 2, 4]
    ledger = assert_exactly_once(
        read_sample_log(samples), dataset_size=4096, batch_size=64, max_steps=steps
    )
    # Data-parallel sizes: 2 at first, then 1 (tp 2) and 4 (tp 1); 4, then 2 (HSDP to FSDP).
    assert ledger["world_sizes"] == sizes


def _step_dir(ckpt: str, step: int) -> str:
    return next(n for n in os.listdir(ckpt) if parse_step_dir(n) == step)


def _first_shard(ckpt: str, step: int) -> str:
    return min(
        n for n in os.listdir(os.path.join(ckpt, _step_dir(ckpt, step))) if n.startswith("shard-")
    )


def _index(ckpt: str, step: int) -> dict:
    folder = os.path.join(ckpt, _step_dir(ckpt, step))
    with open(
        os.path.join(folder, next(n for n in os.listdir(folder) if n.startswith("index-")))
    ) as f:
        return json.load(f)


def _assert_replicas_shared_the_durable_read(ckpt: str, resumed: dict) -> None:
    """Rank 0 needs its shard position's part of the state: about half of it at dp_shard 2. As
    one of two replicas it reads about half of that from the durable tier, the other replica the
    rest (before: all of it, each replica, so 0.5 of the state here)."""
    assert resumed["tier"] == Tier.DURABLE, resumed
    folder = os.path.join(ckpt, _step_dir(ckpt, 120))  # the same state's bytes as at any step
    shards = [os.path.join(folder, n) for n in os.listdir(folder) if n.startswith("shard-")]
    state = sum(os.path.getsize(path) for path in shards)
    assert resumed["remote_bytes"] < 0.4 * state, (resumed["remote_bytes"], state)

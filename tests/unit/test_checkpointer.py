"""elastictrain.checkpoint.checkpointer: the save/resume protocol on one rank of a real gloo
group, on memory:// (the multi-rank protocol runs in tests/integration)."""

from __future__ import annotations

import pytest
import torch

import storage
from elastictrain.checkpoint.api import Reason, Tier
from elastictrain.checkpoint.checkpointer import Checkpointer
from elastictrain.config import CheckpointConfig
from elastictrain.errors import CheckpointFailedError
from elastictrain.observe.events import Event, EventLog, read_events
from tests.helpers.one_process import memory_url, same_weights, state, train

CPU = torch.device("cpu")


def checkpointer(tmp_path, group, generation=1, **settings) -> Checkpointer:
    settings.setdefault("checkpoint_dir", memory_url())
    settings.setdefault("local_checkpoint", False)
    return Checkpointer(
        CheckpointConfig(**settings),
        rank=0,
        world_size=1,
        local_rank=0,
        generation=generation,
        group=group,
        events=EventLog(str(tmp_path / "events.jsonl"), enabled=True),
    )


def test_save_then_resume_restores_the_state_and_fences_the_location(tmp_path, gloo_world):
    ckpt = checkpointer(tmp_path, gloo_world)
    s = state()
    assert ckpt.resume(s, CPU).step == 0 and ckpt.claim() == 1
    for step in range(3):
        train(s, step)
    assert ckpt.save(3, s, Reason.FINAL) and ckpt.last_committed == 3

    again = checkpointer(
        tmp_path, gloo_world, generation=0, checkpoint_dir=ckpt.config.checkpoint_dir
    )
    fresh = state(seed=1)
    resumed = again.resume(fresh, CPU)
    assert (resumed.step, again.last_committed) == (3, 3) and same_weights(fresh, s)
    assert again.claim() == 2  # above the generation that wrote step 3, whatever this one asked
    kinds = [e["event"] for e in read_events(str(tmp_path / "events.jsonl"))]
    assert kinds == [Event.RESUME, Event.CHECKPOINT, Event.RESUME]


def test_a_final_save_storage_refuses_raises_and_leaves_the_record(tmp_path, gloo_world):
    ckpt = checkpointer(tmp_path, gloo_world)
    s = state()
    ckpt.resume(s, CPU)
    ckpt.save(2, s, Reason.STEPS)
    ckpt.writer.wait()
    ckpt.store.commit = lambda *a, **k: (_ for _ in ()).throw(
        storage.StorageUnavailableError("injected outage")
    )
    with pytest.raises(CheckpointFailedError, match="final checkpoint at step 4 .*injected outage"):
        ckpt.save(4, s, Reason.FINAL)
    assert ckpt.last_committed == 2 and ckpt.failure is None  # raised, not recorded


def test_a_corrupt_newest_checkpoint_is_reported_and_the_previous_one_resumed(tmp_path, gloo_world):
    ckpt = checkpointer(tmp_path, gloo_world, async_checkpoint=False, keep_last=5)
    s = state()
    ckpt.resume(s, CPU)
    ckpt.save(1, s, Reason.STEPS)
    saved = state()
    saved.model.load_state_dict(s.model.state_dict())
    train(s, 1)
    ckpt.save(2, s, Reason.STEPS)
    store = storage.open_store(ckpt.config.checkpoint_dir)
    name = next(iter(store.read_manifest(2).files))
    # Damaged behind the store's back (bit rot): the store itself never rewrites a committed file.
    path = store._backend.join(store._backend.root, "step-000000000002", name)
    store._backend.write_atomic(path, b"not the bytes the manifest hashed")

    again = checkpointer(tmp_path, gloo_world, checkpoint_dir=ckpt.config.checkpoint_dir)
    fresh = state(seed=1)
    assert again.resume(fresh, CPU).step == 1 and same_weights(fresh, saved)
    corrupt = [
        e for e in read_events(str(tmp_path / "events.jsonl")) if e["event"] == Event.CORRUPT
    ]
    assert [(e["step"], e["tier"]) for e in corrupt] == [(2, Tier.DURABLE)]


def test_the_local_tier_copies_after_steps_a_resume_prefers_the_newer_copy_and_a_final_save_at_it_still_reaches_the_durable_tier(  # noqa: E501
    tmp_path, gloo_world
):
    url, local = memory_url(), str(tmp_path / "local")
    ckpt = checkpointer(
        tmp_path, gloo_world, checkpoint_dir=url, local_checkpoint=True,
        local_checkpoint_dir=local, local_every_steps=2,
    )  # fmt: skip
    s = state()
    ckpt.resume(s, CPU)
    ckpt.claim()
    for step in range(1, 6):
        train(s, step)
        durable = step == 2 and ckpt.save(2, s, Reason.STEPS)
        ckpt.after_step(step, s, durable_saved=durable)
    ckpt.finish()
    assert ckpt.last_local == 4 and ckpt.last_committed == 2

    again = checkpointer(
        tmp_path, gloo_world, checkpoint_dir=url, local_checkpoint=True,
        local_checkpoint_dir=local,
    )  # fmt: skip
    fresh = state(seed=1)
    assert again.resume(fresh, CPU).step == 4
    resume = [e for e in read_events(str(tmp_path / "events.jsonl")) if e["event"] == "resume"]
    assert resume[-1]["tier"] == Tier.LOCAL and resume[-1]["remote_bytes"] == 0
    assert (resume[-1]["durable_step"], resume[-1]["steps_saved"]) == (2, 2)
    # Step 4 is in node memory only: a preemption (or the end) right after the resume must still
    # write it to the durable tier before the local copies go.
    assert again.last_committed == 2
    again.claim()
    assert again.save(4, fresh, Reason.PREEMPT)
    assert storage.open_store(url).committed_steps() == [2, 4]
    again.finish()


def test_a_step_saved_again_in_one_session_is_skipped_and_its_node_copy_taken_once(
    tmp_path, gloo_world
):
    """``step(N)`` twice (gradient accumulation), then ``save(N)``: every rank writes its shards
    of N once. The skip depends on the steps alone, which every rank is called with alike, so
    every rank skips the same saves without a collective. A final save of N then finds it
    committed and writes nothing; the node tier copies N once too (its schedule is not fooled
    by a copy still in flight), so a buddy never waits for a copy that does not come."""
    from torch import nn

    from elastictrain.checkpoint.state.train_state import TrainState
    from elastictrain.train.parallel import shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    shard(model, None, CPU, 1)
    s = TrainState(model, torch.optim.Adam(model.parameters()))
    ckpt = checkpointer(
        tmp_path, gloo_world, local_checkpoint=True, local_every_steps=5,
        local_checkpoint_dir=str(tmp_path / "shm"),
    )  # fmt: skip
    ckpt.resume(s, CPU)
    ckpt.claim()
    saves, copies = [], []
    real_save, real_copy = ckpt.writer.save, ckpt.local.writer.save
    ckpt.writer.save = lambda step, *a, **k: saves.append(step) or real_save(step, *a, **k)
    ckpt.local.writer.save = lambda step, *a, **k: copies.append(step) or real_copy(step, *a, **k)
    for _ in range(2):
        assert ckpt.save(5, s, Reason.STEPS)
        ckpt.after_step(5, s, durable_saved=True)
    assert ckpt.save(5, s, Reason.STEPS)
    assert (saves, copies) == ([5], [5])
    assert ckpt.save(5, s, Reason.FINAL) and saves == [5]
    assert ckpt.store.read(5).manifest.step == 5
    ckpt.finish()


def test_a_rollback_retracts_the_newer_copies_on_both_tiers_and_loads_the_newest_kept_one(
    tmp_path, gloo_world
):
    """``checkpoint.rollback``: durable 4 and 8, node memory's 8 and 10 (2 kept). Back to 5 or
    before: 8 and 10 retracted on both tiers, 4 loaded, a new generation claimed. Back to 3 or
    before: nothing holds one, so it refuses with nothing retracted."""
    import copy

    from elastictrain.checkpoint.rollback import roll_back
    from elastictrain.errors import NumericalFaultError

    url, local = memory_url(), str(tmp_path / "local")
    ckpt = checkpointer(
        tmp_path, gloo_world, checkpoint_dir=url, local_checkpoint=True,
        local_checkpoint_dir=local, local_every_steps=2,
    )  # fmt: skip
    s = state()
    ckpt.resume(s, CPU)
    ckpt.claim()
    at = {}
    for done in range(1, 11):
        train(s, done - 1)
        durable = done % 4 == 0 and ckpt.save(done, s, Reason.STEPS)
        ckpt.after_step(done, s, durable_saved=durable)
        at[done] = copy.deepcopy(s.model.state_dict())
    ckpt.writer.wait()
    ckpt.local.writer.wait()
    assert storage.open_store(url).committed_steps() == [4, 8]
    assert storage.open_store(local).committed_steps() == [8, 10]
    generation = ckpt.generation

    resumed, retracted = roll_back(ckpt, s, CPU, not_after=5)
    assert (resumed.step, retracted) == (4, [8])
    assert storage.open_store(url).committed_steps() == [4]
    assert storage.open_store(local).committed_steps() == []
    assert ckpt.generation > generation and storage.open_store(url).read_fence() == ckpt.generation
    assert all(v.equal(at[4][k]) for k, v in s.model.state_dict().items())

    with pytest.raises(NumericalFaultError, match="no tier holds a copy at or before step 3"):
        roll_back(ckpt, s, CPU, not_after=3)
    assert storage.open_store(url).committed_steps() == [4]
    # A rank whose own copies were fine stops on another's NaN copy with the same exit code.
    with pytest.raises(NumericalFaultError, match="another rank's background checkpoint copy"):
        ckpt.raise_failure(2)
    ckpt.finish()

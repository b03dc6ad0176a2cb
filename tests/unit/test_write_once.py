"""Write-once through the writers (docs/checkpoints.md, "Write-once"): no path that saves a step
again, checks it, replaces it or cleans up around it can change or delete a committed file. Each
test is one path the issue found by reading; each failed on the code before (a repeated save
truncated a committed shard, rank 0 un-committed a good step mid-rewrite, the foreground commit
rewrote the unsharded rest, an older generation's step was deleted before its replacement
existed, retention deleted a step another rank was writing). Writers of W ranks in one process,
on a local folder: the backend whose ``open`` the faults are injected into."""

from __future__ import annotations

import builtins
import threading

import pytest
import torch

import storage
import storage.local
from elastictrain.checkpoint.api import Reason, SaveOutcome
from elastictrain.checkpoint.policies import StopTheRun
from elastictrain.checkpoint.record import SaveRecord
from elastictrain.checkpoint.write.layouts import FlatLayout
from elastictrain.checkpoint.write.persist import Persister
from elastictrain.checkpoint.write.receipts import StorageReceipts
from elastictrain.config import CheckpointConfig
from elastictrain.observe.events import EventLog
from tests.helpers.shard_snaps import Prebuilt, rank_snaps


class Died(BaseException):
    """The process ended here (SIGKILL, ``os._exit``): nothing of the writer runs after it."""


def writer(
    store, rank=0, world=0, *, generation=5, keep_last=10, attached=lambda: True
) -> Persister:
    """Rank ``rank``'s persister; ``world`` 0: the flat (DDP) layout, else sharded over W."""
    config = CheckpointConfig(checkpoint_dir=store.url, keep_last=keep_last)
    events = EventLog(None, enabled=False)
    layout = Prebuilt(rank, world, StorageReceipts(world)) if world else FlatLayout()
    return Persister(
        store=store, layout=layout, config=config, record=SaveRecord(),
        policy=StopTheRun(config, events), world_size=world or 1,
        generation=lambda: generation, events=events, attached=attached,
        is_committer=rank == 0,
    )  # fmt: skip


def commit_sharded(store, world: int, step: int = 5) -> storage.Manifest:
    """Every rank writes its shard of ``step``, the others first; then rank 0 commits."""
    for rank in reversed(range(world)):
        w = writer(store, rank, world)
        snap = rank_snaps(world, step=step)[rank]
        assert w.save(step, 0, Reason.STEPS, lambda s=snap: s, background=False) == (
            SaveOutcome.COMMITTED, None)  # fmt: skip
    return store.read(step).manifest


def opens_for_writing(monkeypatch, hook) -> None:
    """Every file the local backend opens for writing goes through ``hook(path, file)``."""
    real = builtins.open

    def patched(path, mode="r", *args, **kwargs):
        f = real(path, mode, *args, **kwargs)
        return hook(str(path), f) if ("w" in mode or "x" in mode) else f

    monkeypatch.setattr(storage.local, "open", patched, raising=False)


def test_a_non_committer_saving_a_committed_step_again_and_dying_after_the_open_changes_nothing(
    tmp_path, monkeypatch
):
    store = storage.open_store(str(tmp_path / "ckpt"))
    committed = commit_sharded(store, world=2)

    def dies(path, f):
        f.close()
        raise Died(path)

    opens_for_writing(monkeypatch, dies)
    rank1 = writer(store, 1, 2)
    snap = rank_snaps(2)[1]
    with pytest.raises(Died):
        rank1.save(5, 0, Reason.STEPS, lambda: snap, background=False, commit=False)
    assert store.read(5).manifest == committed  # every file still verifies


def test_rank0s_check_while_another_rank_writes_the_same_step_keeps_the_committed_one(
    tmp_path, monkeypatch
):
    store = storage.open_store(str(tmp_path / "ckpt"))
    committed = commit_sharded(store, world=2)
    inside, release = threading.Event(), threading.Event()

    class Paused:
        """Rank 1's shard write, held between its open and its first byte."""

        def __init__(self, f):
            self.f = f

        def write(self, data):
            inside.set()
            release.wait(10)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    opens_for_writing(monkeypatch, lambda p, f: Paused(f) if "shard-r00001" in p else f)
    snaps = rank_snaps(2)
    rank1 = threading.Thread(
        target=lambda: writer(store, 1, 2).save(
            5, 0, Reason.STEPS, lambda: snaps[1], background=False, commit=False
        )
    )
    rank1.start()
    assert inside.wait(10)
    try:
        outcome = writer(store, 0, 2).save(5, 0, Reason.STEPS, lambda: snaps[0], background=False)
    finally:
        release.set()
        rank1.join(10)
    assert outcome == (SaveOutcome.COMMITTED, None)
    assert store.read_manifest(5) == committed and store.read(5).manifest == committed


def test_a_foreground_commit_of_a_step_storage_already_holds_writes_none_of_its_files(tmp_path):
    """Rank 0's record says step 5 is not committed (the reply to its commit was lost) but
    storage says it is: the final save's commit keeps it, and never rewrites the unsharded rest,
    whose bytes differ now (``extra`` changed since)."""
    store = storage.open_store(str(tmp_path / "ckpt"))
    committed = commit_sharded(store, world=2)
    snaps = rank_snaps(2, extra={"tokens_seen": 7})
    rank0, rank1 = writer(store, 0, 2), writer(store, 1, 2)
    for rank, w in ((1, rank1), (0, rank0)):
        w.save(5, 0, Reason.FINAL, lambda r=rank: snaps[r], background=False, commit=False)
    assert rank0.commit_pending() == (SaveOutcome.COMMITTED, None)
    assert store.read(5).manifest == committed and rank0.record.last_committed == 5


def payload(value: float) -> dict:
    return {"model": {"w": torch.full((256,), value)}, "progress": {"step": 10}}


def test_an_older_generations_step_goes_only_once_its_replacement_is_committed(
    tmp_path, monkeypatch
):
    store = storage.open_store(str(tmp_path / "ckpt"))
    old = writer(store, generation=3)
    assert old.save(10, 0, Reason.STEPS, lambda: payload(1.0), background=False)[0] == (
        SaveOutcome.COMMITTED)  # fmt: skip
    new = writer(store, generation=5)  # a later attempt, whose history does not hold step 10
    real = store._backend.write_atomic

    def refused(path, data):
        raise PermissionError(f"injected: the bucket refused {path}")

    monkeypatch.setattr(store._backend, "write_atomic", refused)
    outcome = new.save(10, 0, Reason.STEPS, lambda: payload(2.0), background=False)[0]
    assert outcome is SaveOutcome.SKIPPED  # the default --on-storage-failure warn
    kept = store.read(10)  # still committed, and every file verifies
    assert kept.manifest.generation == 3 and "state-g3.bin" in kept.files

    monkeypatch.setattr(store._backend, "write_atomic", real)
    assert new.save(10, 0, Reason.STEPS, lambda: payload(2.0), background=False)[0] == (
        SaveOutcome.COMMITTED)  # fmt: skip
    assert store.read(10).manifest.generation == 5
    assert store.names_in(10) == {"state-g5.bin", "manifest.json"}  # the old one's files went


def test_retention_never_deletes_a_step_another_rank_is_writing(tmp_path):
    """A stale generation's late commit at step 100 is above this run's progress; rank 1 is
    writing step 60 while rank 0 commits step 50. Partial cleanup stops at 50, the newest step
    that verifies, not at 100."""
    store = storage.open_store(str(tmp_path / "ckpt"))
    writer(store, generation=1).save(100, 0, Reason.STEPS, lambda: payload(0.0), background=False)
    store.advance_fence(2)
    store.write_file(60, "shard-r00001-g2.bin", b"rank 1, mid-checkpoint" * 100)
    writer(store, generation=2, keep_last=3).save(
        50, 0, Reason.STEPS, lambda: payload(5.0), background=False
    )
    assert store.committed_steps() == [50, 100]
    assert "shard-r00001-g2.bin" in store.names_in(60)


def test_a_stale_commit_that_lands_between_the_check_and_the_commit_is_replaced(tmp_path):
    """An abandoned epoch's persist (generation 3) commits step 10 after generation 5 found it
    free and wrote its files: generation 5's manifest is published over it, not refused."""
    store = storage.open_store(str(tmp_path / "ckpt"))
    calls = []

    def attached() -> bool:  # called before writing, and right before the commit point
        calls.append(1)
        if len(calls) == 2:
            writer(store, generation=3).save(
                10, 0, Reason.STEPS, lambda: payload(3.0), background=False
            )
        return True

    new = writer(store, generation=5, attached=attached)
    assert new.save(10, 0, Reason.STEPS, lambda: payload(5.0), background=False) == (
        SaveOutcome.COMMITTED, None)  # fmt: skip
    assert store.read(10).manifest.generation == 5 and len(calls) == 2

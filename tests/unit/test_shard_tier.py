"""The fast tier for sharded state, in one process: who holds whose copy, which steps a set of
copies covers, and a buddy copy that is committed only once every byte arrived as sent. (Through
its losses with 4 real ranks: tests/integration/test_shard_tier.py.)"""

from __future__ import annotations

import pytest
import torch

import storage
from elastictrain.checkpoint.resume.fast_copies import Copy, complete_steps, list_copies
from elastictrain.checkpoint.tiers import shards as shard_tier
from elastictrain.checkpoint.tiers.shards import Buddy, buddies, own_folder, peer_folder


def test_each_rank_sends_to_the_same_local_rank_one_node_on_and_a_single_node_has_no_buddy():
    # 3 nodes of 2: rank 1 sends to rank 3 (node 1) and keeps rank 5's (node 2, wrapping round).
    assert buddies(1, 6, 2) == (3, 5)
    assert buddies(4, 6, 2) == (0, 2)
    pairs = [buddies(r, 6, 2) for r in range(6)]
    assert sorted(to for to, _ in pairs) == list(range(6))  # every copy is kept exactly once
    assert all(pairs[to][1] == r for r, (to, _) in enumerate(pairs))
    assert buddies(0, 4, 4) is None  # one node: nowhere else to keep a copy


def _copy(
    rank, *, step=10, generation=5, world=4, node="a", kind="own", regular=True, grid=None, twins=()
):
    folder = f"/{node}/{kind}-{rank}"
    return Copy(generation, step, world, rank, regular, grid, node, 0, folder, kind, twins)


def test_a_step_is_a_candidate_only_when_every_saved_rank_has_a_copy_somewhere():
    node_a = [_copy(r) for r in (0, 1)] + [_copy(r, kind="peer") for r in (2, 3)]
    older = [_copy(r, step=5) for r in range(4)]
    assert complete_steps(node_a + older, fence=5, durable_newest=None) == [(5, 10, 4), (5, 5, 4)]
    # Rank 3's only copy of step 10 gone: step 10 is incomplete, step 5 is next.
    assert complete_steps(node_a[:3] + older, fence=5, durable_newest=None) == [(5, 5, 4)]
    # A generation the durable location never fenced (another run's, or a wiped location).
    assert complete_steps(node_a, fence=4, durable_newest=None) == []
    # Not older than the durable tier's newest (an equal step is read from memory).
    assert complete_steps(node_a + older, fence=5, durable_newest=(5, 10)) == [(5, 10, 4)]
    assert complete_steps(node_a + older, fence=5, durable_newest=(5, 11)) == []
    # One copy cut by another rule than the rows: that step is not taken from this tier.
    irregular = node_a[:3] + [_copy(3, kind="peer", regular=False)]
    assert complete_steps(irregular, fence=5, durable_newest=None) == []
    # Cut by grids (HSDP, tensor parallelism): taken when every copy follows the same ones.
    grids = [_copy(r, regular=False, grid="g1") for r in range(4)]
    assert complete_steps(grids, fence=5, durable_newest=None) == [(5, 10, 4)]
    mixed = grids[:3] + [_copy(3, regular=False, grid="g2")]
    assert complete_steps(mixed, fence=5, durable_newest=None) == []
    assert complete_steps(grids[:3] + node_a[3:], fence=5, durable_newest=None) == []


def test_an_hsdp_copy_that_holds_its_twins_chunks_covers_them_but_only_rank_0s_has_the_index():
    # HSDP, a replica on each node: ranks 0-1 on node a are the twins of ranks 2-3 on node b.
    def hsdp(rank, node):
        return _copy(rank, node=node, regular=False, grid="g", twins=(rank % 2, rank % 2 + 2))

    node_a, node_b = [hsdp(r, "a") for r in (0, 1)], [hsdp(r, "b") for r in (2, 3)]
    assert complete_steps(node_a, fence=5, durable_newest=None) == [(5, 10, 4)]  # node b lost
    # Node a lost: node b's copies hold every chunk, but the index is in rank 0's copy alone,
    # which rank 0 always sends to its buddy (rank 2, on node b).
    assert complete_steps(node_b, fence=5, durable_newest=None) == []
    rank_0_at_b = _copy(0, node="b", kind="peer", regular=False, grid="g", twins=(0, 2))
    assert complete_steps([*node_b, rank_0_at_b], fence=5, durable_newest=None) == [(5, 10, 4)]
    # A copy with only its own chunks (no twins listed) covers only its own rank.
    assert complete_steps(node_a[:1] + [_copy(1, regular=False, grid="g")], 5, None) == []


def _sent_copy(tmp_path):
    """A committed copy of rank 2, as its sender holds it: (manifest, files in sending order)."""
    sender = storage.open_store(str(tmp_path / "sender"))
    files = {"shard-r00002-g5.bin": bytes(range(256)) * 600, "part-r00002-g5.json": b'{"x": 1}'}
    entries = {name: sender.write_file(10, name, data, 64 << 10)[0] for name, data in files.items()}
    meta = {"world_size": 4, "rank": 2, "regular": True}
    return sender.commit_written(10, entries, meta, generation=5), files


class _Wire:
    """The sender's side of ``dist.recv``: each message in order, then a dead peer."""

    def __init__(self, messages, dies_after: int):
        self.messages, self.dies_after, self.taken = list(messages), dies_after, 0

    def recv(self, tensor, src, group=None):
        if self.taken == self.dies_after:
            raise RuntimeError("Connection closed by peer (the sender's node is gone)")
        data = self.messages[self.taken]
        self.taken += 1
        tensor.copy_(torch.frombuffer(bytearray(data), dtype=tensor.dtype))


def _messages(manifest, files):
    header = shard_tier._header(manifest, files)
    return [torch.tensor([len(header)], dtype=torch.int64).numpy().tobytes(), header,
            *files.values()]  # fmt: skip


@pytest.mark.parametrize("dies_after", [1, 2, 3])
def test_a_buddy_dying_mid_transfer_leaves_no_committed_copy(tmp_path, monkeypatch, dies_after):
    manifest, files = _sent_copy(tmp_path)
    wire = _Wire(_messages(manifest, files), dies_after)
    monkeypatch.setattr(shard_tier.dist, "recv", wire.recv)
    buddy = Buddy(
        str(tmp_path / "tier"), 0, (2, 2), group=None, checksum=manifest_algorithm(manifest)
    )
    with pytest.raises(RuntimeError, match="Connection closed"):
        buddy._receive()
    assert buddy.store.committed_steps() == []
    assert list_copies(str(tmp_path / "tier"), holder=0) == []


def test_a_buddy_copy_that_arrives_changed_is_not_kept_and_one_that_arrives_whole_is(
    tmp_path, monkeypatch
):
    manifest, files = _sent_copy(tmp_path)
    changed = dict(files)
    shard = bytearray(changed["shard-r00002-g5.bin"])
    shard[1000] ^= 0xFF
    changed["shard-r00002-g5.bin"] = bytes(shard)
    monkeypatch.setattr(shard_tier.dist, "recv", _Wire(_messages(manifest, changed), 99).recv)
    buddy = Buddy(
        str(tmp_path / "tier"), 0, (2, 2), group=None, checksum=manifest_algorithm(manifest)
    )
    with pytest.raises(storage.CheckpointCorruptError, match="arrived with shard-r00002-g5.bin"):
        buddy.keep(*buddy._receive())
    assert buddy.store.committed_steps() == []

    monkeypatch.setattr(shard_tier.dist, "recv", _Wire(_messages(manifest, files), 99).recv)
    buddy.keep(*buddy._receive())
    (copy,) = list_copies(str(tmp_path / "tier"), holder=0)
    assert (copy.rank, copy.step, copy.generation, copy.kind) == (2, 10, 5, "peer")
    assert copy.folder == peer_folder(str(tmp_path / "tier"), 2) != own_folder("x", 2)
    assert bytes(buddy.store.read(10).files["shard-r00002-g5.bin"]) == files["shard-r00002-g5.bin"]


def test_a_copy_received_again_is_kept_as_it_is_and_an_older_generations_goes_only_after(
    tmp_path, monkeypatch
):
    """The same copy twice (a repeated step) leaves the committed peer copy whole: never
    truncated, never deleted with its folder. A newer generation's copy of the same step is
    published over the older one before the older one's files go."""
    manifest, files = _sent_copy(tmp_path)
    buddy = Buddy(str(tmp_path / "tier"), 0, (2, 2), None, manifest_algorithm(manifest))
    for _ in range(2):
        monkeypatch.setattr(shard_tier.dist, "recv", _Wire(_messages(manifest, files), 99).recv)
        buddy.keep(*buddy._receive())
    kept = buddy.store.read(10)  # every file verifies
    assert kept.manifest.generation == 5 and kept.files.keys() == files.keys()

    newer_files = {name.replace("-g5", "-g6"): data for name, data in files.items()}
    sender = storage.open_store(str(tmp_path / "sender6"))
    entries = {n: sender.write_file(10, n, d, 64 << 10)[0] for n, d in newer_files.items()}
    newer = sender.commit_written(10, entries, dict(manifest.metadata), generation=6)
    monkeypatch.setattr(shard_tier.dist, "recv", _Wire(_messages(newer, newer_files), 99).recv)
    buddy.keep(*buddy._receive())
    assert buddy.store.read(10).manifest.generation == 6
    assert buddy.store.names_in(10) == {*newer_files, "manifest.json"}


def manifest_algorithm(manifest) -> str:
    return next(iter(manifest.files.values())).algorithm


def test_the_room_check_counts_every_rank_of_the_node_and_their_buddies_copies(
    tmp_path, gloo_world, monkeypatch
):
    """Room for 3 copies of this rank's shards is not enough: the node's folder holds 3 copies of
    each of its 4 ranks' shards and of the 4 buddies' it keeps. Without it the tier turns off,
    saying so; with it, copies are taken."""
    import collections

    from torch import nn

    from elastictrain.checkpoint.state.train_state import TrainState
    from elastictrain.checkpoint.tiers import local as local_tier
    from elastictrain.checkpoint.tiers.shards import ShardTier
    from elastictrain.config import CheckpointConfig
    from elastictrain.observe.events import Event, EventLog, read_events
    from elastictrain.train.parallel import shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4096), nn.Linear(4096, 1))  # shards well above the slack
    shard(model, None, torch.device("cpu"), 1)
    state = TrainState(model, torch.optim.Adam(model.parameters()))
    state.model(torch.ones(2, 4)).sum().backward()
    state.optimizer.step()  # Adam's moments: the shards are weights + 2 moments
    own = 3 * sum(p.numel() * 4 for p in model.parameters())
    usage = collections.namedtuple("usage", "total used free")

    def tier_with(free: int, name: str) -> ShardTier:
        monkeypatch.setattr(local_tier.shutil, "disk_usage", lambda _: usage(0, 0, free))
        config = CheckpointConfig(
            checkpoint_dir=str(tmp_path / "durable"), local_every_steps=1,
            local_checkpoint_dir=str(tmp_path / name), event_log=str(tmp_path / f"{name}.jsonl"),
        )  # fmt: skip
        return ShardTier(
            config, rank=0, local_rank=0, world_size=1, local_world_size=4,
            generation=lambda: 1, events=EventLog(config.event_log, enabled=True),
            attached=lambda: True, group=gloo_world,
        )  # fmt: skip

    small = tier_with(10 * own, "small")  # 3 copies of this rank's own shards fit, the node's not
    small.after_step(1, state, durable_saved=False)
    assert not small.active
    (off,) = [
        e for e in read_events(str(tmp_path / "small.jsonl")) if e["event"] == Event.LOCAL_TIER
    ]
    assert "free, and the tier needs" in off["why"], off

    roomy = tier_with(100 * own, "roomy")  # 3 x (4 ranks' shards + 4 buddies'): 24 x, and more
    roomy.after_step(1, state, durable_saved=False)
    roomy.finish()
    assert roomy.active and roomy.newest == 1


def test_a_tier_turned_off_for_room_lets_go_of_its_own_older_copies_only(
    tmp_path, gloo_world, monkeypatch
):
    """Two ranks' tiers on one folder (two simulated nodes on a host share /dev/shm). Rank 1's
    next attempt finds no room and turns its tier off: it removes its own older copies, keeps
    its newest (an attempt may have resumed from it), and leaves rank 0's copies alone."""
    import collections

    from torch import nn

    from elastictrain.checkpoint.state.train_state import TrainState
    from elastictrain.checkpoint.tiers import local as local_tier
    from elastictrain.checkpoint.tiers.shards import ShardTier
    from elastictrain.config import CheckpointConfig
    from elastictrain.observe.events import EventLog
    from elastictrain.train.parallel import shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 1))
    shard(model, None, torch.device("cpu"), 1)
    state = TrainState(model, torch.optim.Adam(model.parameters()))
    usage = collections.namedtuple("usage", "total used free")
    config = CheckpointConfig(
        checkpoint_dir=str(tmp_path / "durable"), local_every_steps=1,
        local_checkpoint_dir=str(tmp_path / "shm"),
    )  # fmt: skip

    def tier(rank: int, free: int) -> ShardTier:
        monkeypatch.setattr(local_tier.shutil, "disk_usage", lambda _: usage(0, 0, free))
        return ShardTier(
            config, rank=rank, local_rank=rank, world_size=2, local_world_size=2,
            generation=lambda: 1, events=EventLog(None, enabled=False),
            attached=lambda: True, group=gloo_world,
        )  # fmt: skip

    for rank in (0, 1):
        roomy = tier(rank, 1 << 40)
        for step in (1, 2):
            roomy.after_step(step, state, durable_saved=False)
            roomy.writer.wait()
        roomy.finish()
    cramped = tier(1, 1)
    cramped.after_step(3, state, durable_saved=False)
    assert not cramped.active
    folders = {r: storage.open_store(own_folder(str(tmp_path / "shm"), r)) for r in (0, 1)}
    assert folders[1].step_dirs() == [2] and folders[1].read(2)
    assert folders[0].committed_steps() == [1, 2] and folders[0].read(1) and folders[0].read(2)

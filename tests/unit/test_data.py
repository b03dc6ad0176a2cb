from __future__ import annotations

import pytest
import torch

from elastictrain.errors import ConfigError
from elastictrain.train.data import GlobalBatchSampler, share_bounds, step_seed


@pytest.mark.parametrize("world", [1, 2, 3, 5, 7])
def test_each_epoch_trains_every_sample_once_at_any_world_size(world):
    sampler = GlobalBatchSampler(dataset_size=100, batch_size=10, seed=3)
    for epoch in range(2):
        seen = []
        for step in range(epoch * 10, (epoch + 1) * 10):
            for rank in range(world):
                share = sampler.share(step, rank, world)
                assert share.epoch == epoch
                seen += share.indices.tolist()
        assert sorted(seen) == list(range(100))


def test_global_batch_is_independent_of_world_size():
    a, b = GlobalBatchSampler(64, 8, seed=1), GlobalBatchSampler(64, 8, seed=1)
    for step in range(20):
        merged = torch.cat([b.share(step, r, 3).indices for r in range(3)])
        assert torch.equal(a.global_batch(step), merged)


def test_epochs_and_seeds_shuffle_differently():
    s = GlobalBatchSampler(64, 8, seed=1)
    assert not torch.equal(s.permutation(0), s.permutation(1))
    assert not torch.equal(s.permutation(0), GlobalBatchSampler(64, 8, seed=2).permutation(0))


@pytest.mark.parametrize("batch,world", [(10, 3), (64, 5), (7, 7), (9, 2)])
def test_uneven_shares_weights_give_global_mean(batch, world):
    sizes = [e - s for s, e in (share_bounds(batch, r, world) for r in range(world))]
    assert sum(sizes) == batch and max(sizes) - min(sizes) <= 1
    # sum_r (n_r * W / B) * mean_r / W == global mean when every per-sample loss is 1.
    sampler = GlobalBatchSampler(batch * 2, batch, seed=0)
    weights = [sampler.share(0, r, world).weight for r in range(world)]
    assert sum(weights) / world == pytest.approx(1.0)


def test_world_larger_than_batch_is_a_clear_error():
    with pytest.raises(ConfigError, match="World size 9 exceeds the global batch size 8"):
        GlobalBatchSampler(64, 8, seed=0).share(0, 0, 9)


def test_step_seed_is_stable_and_distinct():
    assert step_seed(0, 5, 1) == step_seed(0, 5, 1)
    assert len({step_seed(0, s, r) for s in range(50) for r in range(4)}) == 200


@pytest.mark.parametrize("world,accum", [(1, 4), (3, 2), (3, 3), (4, 2)])
def test_micro_batches_cover_the_share_and_weigh_to_the_global_mean(world, accum):
    from elastictrain.train.loader import micro_shares

    sampler = GlobalBatchSampler(dataset_size=100, batch_size=10, seed=3)
    for rank in range(world):
        share = sampler.share(5, rank, world)
        pieces = micro_shares(sampler, 5, rank, world, accum)
        assert len(pieces) == accum and all(len(p.indices) for p in pieces)
        assert torch.equal(torch.cat([p.indices for p in pieces]), share.indices)
        # Each piece's weight is its sample count * W / B: the pieces add up to the share's.
        assert sum(p.weight for p in pieces) == pytest.approx(share.weight)


def test_more_micro_batches_than_samples_is_refused_with_the_fix():
    from elastictrain.train.loader import check_micro_steps

    with pytest.raises(ConfigError, match="--grad-accum-steps 4 is more than the 3 samples"):
        check_micro_steps(batch_size=10, world_size=3, micro_steps=4)

"""train.replicas in one process: the digest, the twins, the majority."""

from __future__ import annotations

import torch
from torch import nn

from elastictrain.mesh import MeshShape
from elastictrain.train import replicas


def test_one_flipped_bit_changes_the_digest_and_an_identical_copy_does_not():
    torch.manual_seed(0)
    a, b = nn.Linear(8, 4), nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    assert replicas.digest(a) == replicas.digest(b)
    replicas.flip_a_bit(b)
    assert replicas.digest(a) != replicas.digest(b)
    assert torch.isfinite(b.weight).all()


def test_twins_are_every_rank_under_ddp_and_the_same_shard_under_hsdp():
    assert {replicas.twin_key(None, r) for r in range(4)} == {0}
    hsdp = MeshShape(dp_replicate=2, dp_shard=2, tp=1)  # ranks 0,1 | 2,3: twins 0-2 and 1-3
    assert [replicas.twin_key(hsdp, r) for r in range(4)] == [0, 1, 0, 1]


def test_the_suspects_are_outside_a_strict_majority_and_there_is_none_without_one():
    assert replicas._outside_majority([(0, 7), (1, 7), (2, 9)]) == [2]
    assert replicas._outside_majority([(0, 7), (1, 9)]) == []
    assert replicas._outside_majority([(0, 7), (1, 7), (2, 9), (3, 9)]) == []

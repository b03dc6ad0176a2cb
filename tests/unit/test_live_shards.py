"""Which survivor's shards each rank loads in an in-place epoch (``live_shards.plan``), and the
signature that says two ranks' shards are interchangeable."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from elastictrain.checkpoint.resume.live_shards import plan, signature

A, B, C, D = "pos-a", "pos-b", "pos-c", "pos-d"
NONE = (-1, None)  # a replacement holds nothing


def test_hsdp_a_replacement_loads_its_twins_shards_and_survivors_their_own():
    # 2x2: ranks 0 and 2 hold shard position A, ranks 1 and 3 position B; rank 1 was replaced.
    found = plan([(5, A), NONE, (5, A), (5, B)], [A, B, A, B])
    assert (found.step, found.sources) == (5, [0, 3, 2, 3])


def test_a_survivor_one_step_behind_loads_a_twins_newer_shards():
    found = plan([(5, A), NONE, (4, A), (5, B)], [A, B, A, B])
    assert (found.step, found.sources) == (5, [0, 3, 0, 3])


def test_shard_positions_at_different_steps_have_no_whole_step():
    # Position A stepped to 5, position B's only survivor is at 4: no step is whole in memory,
    # and a mix of steps is never loaded (the caller rolls back to the copies).
    assert plan([(5, A), NONE, (5, A), (4, B)], [A, B, A, B]) is None


def test_fsdp_without_replicas_has_no_survivor_holding_the_dead_ranks_shards():
    assert plan([(5, A), NONE, (5, C), (5, D)], [A, B, C, D]) is None


def test_a_lost_replica_leaves_every_survivor_its_own_shards():
    # After a lost node: two survivors, each wanting exactly what it holds.
    found = plan([(7, A), (7, B)], [A, B])
    assert (found.step, found.sources) == (7, [0, 1])


def test_a_mesh_that_shards_differently_now_holds_no_step():
    assert plan([(7, A), (7, B)], [C]) is None


def _fake(shape, boxes, dtype=torch.float32):
    chunks = [SimpleNamespace(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in boxes]
    return SimpleNamespace(
        shape=torch.Size(shape), dtype=dtype, __create_chunk_list__=lambda: chunks
    )


def test_the_signature_is_the_chunks_held_not_the_rank():
    first = {"model/w": _fake((8, 4), [((0, 0), (4, 4))])}
    twin = {"model/w": _fake((8, 4), [((0, 0), (4, 4))])}
    other = {"model/w": _fake((8, 4), [((4, 0), (4, 4))])}
    assert signature(first) == signature(twin)
    assert signature(first) != signature(other)
    assert signature(first) != signature(
        {"model/w": _fake((8, 4), [((0, 0), (4, 4))], torch.bfloat16)}
    )
    assert signature(first) != signature({"model/v": _fake((8, 4), [((0, 0), (4, 4))])})

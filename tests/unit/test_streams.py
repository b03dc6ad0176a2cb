"""Streams in one process: the positions each share reports are the samples the stream gave, a
restored state continues where it stopped, a seek at another world size continues exactly once,
and what cannot continue is refused before anything is loaded."""

from __future__ import annotations

import pytest
import torch

from elastictrain.errors import CheckpointMismatchError, ConfigError
from elastictrain.train.streams import UNKNOWN, StreamLoader, check_stream
from tests.helpers.stream_task import PlainStream, SeekableStream, StatefulStream

BATCH = 12


def _loader(stream, rank: int, world: int, workers: int = 0) -> StreamLoader:
    return StreamLoader(
        dataset=stream,
        batch_size=BATCH,
        rank=rank,
        world_size=world,
        micro_steps=2,
        collate_fn=torch.utils.data.default_collate,
        num_workers=workers,
    )


def _trained(loaders, steps) -> list[tuple[int, list[int], list[int]]]:
    """(step, the positions each share claims, the samples' own positions) for every rank."""
    out = []
    for step in steps:
        for loader in loaders:
            for share, (_, _, p) in loader.next_step(step):
                out.append((step, share.indices.tolist(), p.tolist()))
    return out


def test_a_seekable_stream_resumes_exactly_at_its_world_size_and_exactly_once_at_another():
    """In one process, as two ranks then three: the positions each share reports are the samples
    the stream gave, a restored state continues where it stopped, and a seek at another world
    size continues with the first untrained sample."""
    first = [_loader(SeekableStream(), r, 2) for r in range(2)]
    for loader in first:
        loader.start(0)
    before = _trained(first, range(3))
    assert all(claimed == seen for _, claimed, seen in before)
    states = [loader.state_dict() for loader in first]
    straight = _trained(first, range(3, 5))

    again = [_loader(SeekableStream(), r, 2) for r in range(2)]
    for loader in again:
        loader.check_rank_states(states, 3, "here")
        loader.load_rank_states(states, 3)
        loader.start(3)
    assert _trained(again, range(3, 5)) == straight  # the same samples, in the same order

    wider = [_loader(SeekableStream(), r, 3) for r in range(3)]
    for loader in wider:
        loader.check_rank_states(states, 3, "here")
        loader.load_rank_states(states, 3)
        loader.start(3)
    after = _trained(wider, range(3, 6))
    assert all(claimed == seen for _, claimed, seen in after)
    samples = sorted(p for _, _, seen in before + after for p in seen)
    assert samples == list(range(6 * BATCH))  # every sample of the first 6 steps, once


def test_a_tensor_parallel_group_saves_one_position_and_resumes_from_its_own_data_rank():
    """Under tp=2 the four ranks of (dp 2, tp 2) save four positions, two per data-parallel rank;
    each rank resumes from its data-parallel rank's, whichever group member saved it, and a
    stateful stream without seek resumes exactly at the same data-parallel size."""
    groups = [_loader(StatefulStream(), r, 2) for r in range(2)]
    for loader in groups:
        loader.start(0)
        loader.next_step(0)
    states = [groups[r // 2].state_dict() for r in range(4)]  # saved by global rank, tp inner
    straight = _trained(groups, range(1, 3))
    again = [_loader(StatefulStream(), r, 2) for r in range(2)]
    for loader in again:
        loader.check_rank_states(states, 1, "here")  # 4 saved, data-parallel size 2: exact
        loader.load_rank_states(states, 1)
        loader.start(1)
    assert _trained(again, range(1, 3)) == straight
    with pytest.raises(CheckpointMismatchError, match="data-parallel size 2; this run has 3"):
        _loader(StatefulStream(), 0, 3).check_rank_states(states, 1, "here")


def test_streams_that_cannot_continue_are_refused_before_anything_is_loaded():
    stateful = _loader(StatefulStream(), 0, 2)
    stateful.start(0)
    stateful.next_step(0)
    states = [stateful.state_dict()] * 2
    with pytest.raises(CheckpointMismatchError, match="no seek.*Nothing was loaded"):
        _loader(StatefulStream(), 0, 3).check_rank_states(states, 1, "here")
    seekable = _loader(SeekableStream(), 0, 2, workers=2)  # workers interleave: not a prefix
    assert seekable.state_dict()["prefix"] is False
    seekable.start(0)
    shares = [share for share, _ in seekable.next_step(0)]
    assert shares[0].indices.tolist() == [UNKNOWN] * 3  # the sample log cannot name positions
    seekable.close()
    with pytest.raises(CheckpointMismatchError, match="2 loader workers"):
        _loader(SeekableStream(), 0, 3).check_rank_states([seekable.state_dict()] * 2, 1, "x")
    with pytest.raises(ConfigError, match=r"IterableDataset \(PlainStream\) without state_dict"):
        check_stream(PlainStream(), BATCH, 2, 1)
    with pytest.raises(ConfigError, match="does not divide over 5 ranks"):
        check_stream(SeekableStream(), BATCH, 5, 1)

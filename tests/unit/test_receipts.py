"""elastictrain.checkpoint.write.receipts: rank 0 commits a sharded step only with every rank's receipt
of that step and generation, through either carrier (a real TCPStore, or files on storage); a rank
that gave up or never posts leaves the step uncommitted instead of hanging; through the store,
rank 0's requests do not grow with W and old receipts do not pile up."""

from __future__ import annotations

import collections
import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

import storage
from elastictrain.bench.scale_phases import CountingStore
from elastictrain.checkpoint.write.receipts import (
    ShardsMissingError,
    StorageReceipts,
    StoreReceipts,
)


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10))
    yield store
    del store


def _client(server) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10))


@pytest.fixture(params=["store", "storage"])
def carrier(request, tmp_path):
    """``make(world)`` -> one Receipts per rank, sharing a carrier, and the checkpoint store."""
    ckpt = storage.open_store(str(tmp_path / "c"))
    if request.param == "storage":
        return lambda world: ([StorageReceipts(world) for _ in range(world)], ckpt)
    client = _client(request.getfixturevalue("server"))  # one connection: ranks' threads share it
    return lambda world: ([StoreReceipts(client, world) for _ in range(world)], ckpt)


def _post(receipts, ckpt, rank: int, step: int = 3, generation: int = 7) -> None:
    receipts[rank].post(ckpt, step, generation, rank, json.dumps({"rank": rank}).encode())


def test_waits_until_every_rank_posted_and_ignores_another_generation(carrier):
    receipts, ckpt = carrier(3)
    _post(receipts, ckpt, 0)
    _post(receipts, ckpt, 2)
    _post(receipts, ckpt, 1, generation=6)  # a stale writer's receipt does not count
    late = threading.Timer(0.3, lambda: _post(receipts, ckpt, 1))
    late.start()
    t0 = time.monotonic()
    got = receipts[0].gather(ckpt, 3, 7, lambda s: False, deadline_s=10)
    late.join()  # its post finishes before the store goes away with the test
    assert time.monotonic() - t0 >= 0.25
    assert [r["rank"] for r in got] == [0, 1, 2]


def test_a_rank_that_gave_up_or_never_posts_ends_the_wait_naming_it(carrier):
    receipts, ckpt = carrier(3)
    _post(receipts, ckpt, 0)
    _post(receipts, ckpt, 2)
    with pytest.raises(ShardsMissingError, match=r"rank\(s\) \[1\].*gave up"):
        receipts[0].gather(ckpt, 3, 7, lambda s: s == 3, deadline_s=60)
    with pytest.raises(ShardsMissingError, match=r"rank\(s\) \[1\].*did not report in 0s"):
        receipts[0].gather(ckpt, 3, 7, lambda s: False, deadline_s=0.05)
    assert not ckpt.is_committed(3)
    # Skippable under --on-storage-failure warn, like any storage outage.
    assert isinstance(ShardsMissingError("x"), storage.StorageUnavailableError)


@pytest.mark.parametrize("world", [4, 64])
def test_through_the_store_rank_0_makes_the_same_few_requests_at_any_world_size(server, world):
    counts: collections.Counter = collections.Counter()
    rank0 = StoreReceipts(CountingStore(_client(server), counts, "rank 0"), world)
    shared = _client(server)  # one connection for the other ranks, each counted apart
    others = [StoreReceipts(CountingStore(shared, counts, r), world) for r in range(1, world)]
    ckpt = None  # the store carrier never touches storage
    for step in (10, 20):
        _post([rank0, *others], ckpt, 0, step=step)
        for r, receipts in enumerate(others, start=1):
            receipts.post(ckpt, step, 7, r, json.dumps({"rank": r}).encode())
        assert [g["rank"] for g in rank0.gather(ckpt, step, 7, lambda s: False, 10)] == list(
            range(world)
        )
    # Per checkpoint: rank 0 posts (set, add, check/delete) and gathers (wait, multi_get, 2 deletes).
    assert counts["rank 0"] <= 2 * 8
    assert max(counts[r] for r in range(1, world)) <= 2 * 4
    # What the store still holds: the last step's receipts, not every step's.
    assert server.num_keys() <= world + 2


def test_the_last_rank_to_post_completes_the_step_even_out_of_order(server):
    world = 8
    client = _client(server)
    receipts = [StoreReceipts(client, world) for _ in range(world)]
    threads = [
        threading.Thread(target=_post, args=(receipts, None, r)) for r in reversed(range(world))
    ]
    for t in threads:
        t.start()
    got = receipts[0].gather(None, 3, 7, lambda s: False, deadline_s=10)
    for t in threads:
        t.join()
    assert [g["rank"] for g in got] == list(range(world))


def test_polling_backs_off_to_its_ceiling_and_gives_up_at_the_deadline_on_the_given_clock(tmp_path):
    """The clock and the sleep are parameters: an hour-long deadline is checked in no real time,
    and the polls double from 5 ms to 0.5 s instead of hammering storage."""
    ckpt = storage.open_store(str(tmp_path / "c"))
    now, slept = [0.0], []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    receipts = StorageReceipts(2, clock=lambda: now[0], sleep=sleep)
    _post([receipts], ckpt, 0)
    t0 = time.monotonic()
    with pytest.raises(ShardsMissingError, match="1"):
        receipts.gather(ckpt, 3, 7, lambda s: False, deadline_s=3600)
    assert time.monotonic() - t0 < 30 and now[0] > 3600
    assert slept[:3] == [0.005, 0.01, 0.02] and max(slept) == 0.5 and slept[-1] == 0.5

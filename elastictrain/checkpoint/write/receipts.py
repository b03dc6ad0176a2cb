"""How rank 0 learns that every rank's shard of a sharded step is durable, before it commits.

Each rank, once its shard and table are durable, posts a receipt of ~300 bytes (both files' sizes
and hashes, and whether its chunks follow the row rule). Rank 0 gathers all W receipts of (step,
generation) and commits only with all of them; a rank that gave up, or never posts within
``--checkpoint-timeout``, leaves the step uncommitted (:class:`ShardsMissingError`). Two ways to
carry them, with the same meaning:

- :class:`StoreReceipts`, in a job with torch.distributed: the receipt goes to the job's c10d store
  (the attempt's own prefix, so a receipt never outlives its rendezvous). The rank that completes
  the count marks the step complete, and rank 0 blocks on that one key and fetches all W receipts
  with one ``multi_get``: 4 store requests for the gather and 3 to 5 for each post, whatever W. The
  storage way made rank 0 issue W GETs, whose per-request CPU, not their latency, was the
  commit's floor at large W (docs/measurements.md).
- :class:`StorageReceipts`, without a c10d store (one process, the unit tests): a file
  ``step-N/done-r*-g*.json`` per rank, which rank 0 reads 256 at a time.

No collective either way: the training threads never wait for a commit.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

import storage
from elastictrain.checkpoint.sharded import format as sharded

_READ_LANES = 256  # concurrent receipt reads from storage: 32 rounds at W = 8,192
_POLL_S = (0.005, 0.5)  # the wait for other ranks' receipts: first and longest poll interval
_WAIT_SLICE_S = 1.0  # rank 0 blocks on the store this long at a time, then checks for give-ups


class ShardsMissingError(storage.StorageUnavailableError):
    """Some rank's shard never became durable, so the step cannot be committed."""


def _missing(step: int, missing: list[int], gave_up: bool, deadline_s: float) -> ShardsMissingError:
    why = "gave up on it" if gave_up else f"did not report in {deadline_s:.0f}s"
    return ShardsMissingError(
        f"the shards of rank(s) {missing[:8]} for step {step} never became durable "
        f"(a rank {why}); the step is not committed"
    )


class Receipts(Protocol):
    def post(
        self, store: storage.Store, step: int, generation: int, rank: int, receipt: bytes
    ) -> None:
        """This rank's receipt: call only once its shard and table are durable."""

    def gather(
        self,
        store: storage.Store,
        step: int,
        generation: int,
        abandoned: Callable[[int], bool],
        deadline_s: float,
    ) -> list[dict[str, Any]]:
        """Rank 0: every rank's receipt, in rank order, or :class:`ShardsMissingError`."""


def for_job(world_size: int) -> Receipts:
    """The store when torch.distributed has one, else storage."""
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        # The default group's store: the one every rank of this attempt shares (private in
        # torch, stable since 1.x; a store-less init falls back to storage).
        store = dist.distributed_c10d._get_default_store()
        if store is not None:
            return StoreReceipts(store, world_size)
    return StorageReceipts(world_size)


class StoreReceipts:
    """Receipts in the job's c10d store, keyed by generation and step (so a stale writer's never
    count), one key per rank, a counter, and a key the last rank to post sets."""

    def __init__(
        self, store: dist.Store, world_size: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.store, self.world_size, self.clock = store, world_size, clock
        self._waiter: dist.Store | None = None  # rank 0's own connection: its waits block nobody
        self._posted: str | None = None  # this rank's last step prefix, deleted once gathered

    @staticmethod
    def _prefix(step: int, generation: int) -> str:
        return f"elastictrain/receipts/g{generation}/s{step}/"

    def post(
        self, store: storage.Store, step: int, generation: int, rank: int, receipt: bytes
    ) -> None:
        prefix = self._prefix(step, generation)
        self.store.set(f"{prefix}r{rank}", receipt)
        if self.store.add(f"{prefix}count", 1) == self.world_size:
            self.store.set(f"{prefix}all", b"1")
        previous, self._posted = self._posted, prefix
        # The previous step's receipt, once rank 0 has gathered it (it deletes the count then):
        # the store keeps at most a step or two of receipts, without W deletes on rank 0.
        if previous is not None and not self.store.check([f"{previous}count"]):
            self.store.delete_key(f"{previous}r{rank}")

    def gather(
        self,
        store: storage.Store,
        step: int,
        generation: int,
        abandoned: Callable[[int], bool],
        deadline_s: float,
    ) -> list[dict[str, Any]]:
        if self._waiter is None:
            self._waiter = self.store.clone()
        waiter, prefix = self._waiter, self._prefix(step, generation)
        deadline = self.clock() + deadline_s
        while True:
            left = deadline - self.clock()
            try:
                waiter.wait(
                    [f"{prefix}all"], timedelta(seconds=max(0.001, min(_WAIT_SLICE_S, left)))
                )
                break
            except dist.DistStoreError:  # this slice timed out
                gave_up = abandoned(step)
                if gave_up or self.clock() >= deadline:
                    raise _missing(
                        step, self._absent(waiter, prefix), gave_up, deadline_s
                    ) from None
        raw = waiter.multi_get([f"{prefix}r{r}" for r in range(self.world_size)])
        for key in ("all", "count"):
            waiter.delete_key(f"{prefix}{key}")
        return [json.loads(bytes(r)) for r in raw]

    def _absent(self, waiter: dist.Store, prefix: str) -> list[int]:
        """The first ranks without a receipt (the failure path only: one check per rank)."""
        absent = []
        for r in range(self.world_size):
            if not waiter.check([f"{prefix}r{r}"]):
                absent.append(r)
                if len(absent) == 8:
                    break
        return absent


class StorageReceipts:
    """Receipts as files beside the shards, polled by rank 0."""

    def __init__(
        self,
        world_size: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """``clock`` and ``sleep``: the deadline's and the polling's (a test passes fakes)."""
        self.world_size, self.clock, self.sleep = world_size, clock, sleep

    def post(
        self, store: storage.Store, step: int, generation: int, rank: int, receipt: bytes
    ) -> None:
        store.write_note(step, sharded.receipt_file(rank, generation), receipt)

    def gather(
        self,
        store: storage.Store,
        step: int,
        generation: int,
        abandoned: Callable[[int], bool],
        deadline_s: float,
    ) -> list[dict[str, Any]]:
        """Read many at once: first all of them, since by rank 0's commit most ranks are done,
        then after each listing the ones it shows."""
        wanted = {sharded.receipt_file(r, generation): r for r in range(self.world_size)}
        got: dict[int, dict[str, Any]] = {}
        deadline = self.clock() + deadline_s
        pause = _POLL_S[0]
        first = True
        while True:
            present = set(wanted) if first else store.names_in(step)  # a listing is W/1000 pages
            first = False
            new = [n for n, r in wanted.items() if r not in got and n in present]
            read = read_all(lambda n: store.read_uncommitted(step, n), new)
            for name, raw in zip(new, read, strict=True):
                if raw is not None:
                    got[wanted[name]] = json.loads(raw)
            if len(got) == len(wanted):
                return [got[r] for r in range(self.world_size)]
            gave_up = abandoned(step)
            if gave_up or self.clock() > deadline:
                missing = sorted(set(range(self.world_size)) - set(got))
                raise _missing(step, missing, gave_up, deadline_s)
            self.sleep(pause)
            pause = min(pause * 2, _POLL_S[1])


def read_all(read: Callable[[str], bytes | None], names: list[str]) -> list[bytes | None]:
    """``read`` of every name, up to 256 at a time: small files, so requests, not bandwidth, are
    the cost (on S3 through s3fs, raise botocore's ``max_pool_connections`` to match:
    docs/scale.md). Each thread reads its own slice in turn: one task per thread, not one per
    name, because at W = 8,192 the pool's per-task queueing cost more than the reads' CPU."""
    if len(names) <= 1:
        return [read(n) for n in names]
    lanes = min(_READ_LANES, len(names))
    got: list[bytes | None] = [None] * len(names)

    def lane(first: int) -> None:
        for i in range(first, len(names), lanes):
            got[i] = read(names[i])

    with ThreadPoolExecutor(lanes) as pool:
        for done in [pool.submit(lane, first) for first in range(lanes)]:
            done.result()  # re-raises the first failed read
    return got

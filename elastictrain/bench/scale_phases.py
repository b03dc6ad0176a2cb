"""The phases ``bench scale`` times at each W (``scale``'s docstring says what each one runs):
the handshake over one real TCPStore, the sharded commit, rank 0's resume checks, and one rank's
read plan; and the instruments they count with (store requests, storage latency)."""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

import storage
from elastictrain.bench import throttled_fs
from elastictrain.checkpoint.sharded import format as sharded
from elastictrain.checkpoint.sharded.grid import Grid
from elastictrain.checkpoint.sharded.reader import Index
from elastictrain.checkpoint.state.flat import Staging
from elastictrain.checkpoint.write.layouts import ShardedLayout, ShardSnap
from elastictrain.checkpoint.write.receipts import StoreReceipts
from elastictrain.cluster.env import DistEnv
from elastictrain.cluster.handshake import handshake


@dataclass
class Row:
    phase: str
    world: int
    requests: int | None = None
    """Store or storage requests in the phase (the handshake: all ranks; the rest: rank 0's)."""
    metadata_bytes: int | None = None
    seconds: float | None = None
    """The phase's critical path, latency included."""
    note: str = ""


# -- the synthetic sharded state ------------------------------------------------------------------
def tensor_names(count: int) -> list[str]:
    kinds = ("model", "optimizer.exp_avg", "optimizer.exp_avg_sq")
    return [f"{kinds[i % 3]}.layers.{i // 3}.weight" for i in range(count)]


LAYOUTS = ("fsdp", "hsdp", "tp")
"""fsdp: ``Shard(0)`` over all W ranks (index format 2); hsdp: W/8 replicas of 8 shards, each
tensor written by one replica (format 3); tp: (dp_shard W/2, tp 2), rows over dp_shard and
columns over tp, as FSDP over a row-wise layer (format 3)."""


def _grid(layout: str, world: int, index: int) -> Grid:
    if layout == "hsdp":  # tensors of one shape are dealt to the replicas in turn
        return Grid((8, 2), "float32", (world // 8, 8), ((0, (1,)),), (0,), index % (world // 8))
    return Grid((world // 2, 2), "float32", (world // 2, 2), ((0, (0,)), (1, (1,))), (), 0)


def _shards_of(
    rank: int, world: int, names: list[str], tensors: dict, layout: str = "fsdp"
) -> sharded.LocalShards:
    """Rank ``rank``'s chunks: under ``fsdp`` one row of a (world, 2) float32 tensor each; under
    the grid layouts what the tensor's grid gives the rank, for each tensor its replica writes."""
    if layout == "fsdp":
        chunks = [
            {
                "fqn": n,
                "dtype": "float32",
                "size": [world, 2],
                "offsets": [rank, 0],
                "sizes": [1, 2],
            }
            for n in names
        ]
        return sharded.LocalShards(tensors, chunks)
    grids = {n: _grid(layout, world, i) for i, n in enumerate(names)}
    coordinate = [rank // 8, rank % 8] if layout == "hsdp" else [rank // 2, rank % 2]
    chunks = []
    for n, g in grids.items():
        if all(coordinate[m] == c for m, c in g.writers().items()):
            offsets, sizes = g.chunk(coordinate)
            chunks.append(
                {
                    "fqn": n,
                    "dtype": "float32",
                    "size": list(g.size),
                    "offsets": offsets,
                    "sizes": sizes,
                }
            )
    mine = {c["fqn"]: tensors[c["fqn"]] for c in chunks}
    return sharded.LocalShards(mine, chunks, layout == "hsdp", grids)


# -- the phases ------------------------------------------------------------------------------------
class CountingStore:
    """A store client that counts its requests in ``counts`` (under ``key``, else by method);
    client-side calls such as ``set_timeout`` are not requests."""

    def __init__(self, store: Any, counts: collections.Counter, key: Any = None) -> None:
        self._store, self._counts, self._key = store, counts, key

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._store, name)
        if not callable(fn) or name == "set_timeout":
            return fn

        def counted(*args, **kwargs):
            self._counts[name if self._key is None else self._key] += 1  # atomic under the GIL
            return fn(*args, **kwargs)

        return counted

    def clone(self) -> CountingStore:
        """A new connection, counted with this one."""
        return CountingStore(self._store.clone(), self._counts, self._key)


def _env(rank: int, world: int, port: int) -> DistEnv:
    return DistEnv(
        rank=rank,
        world_size=world,
        local_rank=0,
        local_world_size=1,
        master_addr="127.0.0.1",
        master_port=port,
        restart_count=0,
        max_restarts=0,
        run_id="scale",
        use_agent_store=True,
        launched_by_torchrun=True,
    )


def run_handshake(world: int) -> Row:
    import torch.distributed as dist

    timeout = timedelta(seconds=300)
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
    t0 = time.perf_counter()
    # Connected first, 64 at a time: some of torch's client connects stall for 5 s under a burst
    # (docs/scale.md), which would otherwise dominate the harness, not the protocol.
    with ThreadPoolExecutor(64) as pool:
        clients = list(
            pool.map(
                lambda _: dist.TCPStore("127.0.0.1", server.port, None, False, timeout),
                range(world),
            )
        )
    connect_s = time.perf_counter() - t0
    counts: collections.Counter = collections.Counter()
    errors: list[BaseException] = []
    done = [0.0] * world

    def rank(r: int) -> None:
        try:
            handshake(CountingStore(clients[r], counts), _env(r, world, server.port), 300)
            done[r] = time.perf_counter()
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    previous = threading.stack_size(256 << 10)  # 8,192 threads at the default 8 MB is 64 GB
    # Thousands of threads woken at once queue for the GIL, 5 ms a hand-off by default: that
    # measures this harness, not the protocol (docs/measurements.md).
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    t0 = time.perf_counter()
    try:
        for t in threads:
            t.start()
        started_s = time.perf_counter() - t0
        for t in threads:
            t.join()
    finally:
        threading.stack_size(previous)
        sys.setswitchinterval(switch)
    if errors:
        raise errors[0]
    total = sum(counts.values())
    return Row(
        "handshake",
        world,
        total,
        None,
        max(done) - t0,
        f"{total / world:.1f} requests/rank; all joined (rank 0 done) at "
        f"{done[0] - t0:.2f}s, the threads started by {started_s:.2f}s; {world} "
        f"connects took {connect_s:.1f}s before, untimed",
    )


def _receipts_client(port: int) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=300))


def _write_ranks(
    url: str, world: int, ranks: range, tensor_count: int, port: int, layout: str = "fsdp"
) -> None:
    """Ranks ``ranks``' shard, table and receipt, as ``ShardedLayout.write_own`` writes them, the
    receipts into the job's store at ``port`` (one connection for these ranks: a client per rank
    changes nothing the commit does, and 8,192 connects would dominate the harness)."""
    names = tensor_names(tensor_count)
    tensors = {n: torch.zeros(1, 2) for n in names}
    store = storage.CheckpointStore(url)
    client = _receipts_client(port)
    for r in ranks:
        local = _shards_of(r, world, names, tensors, layout)
        # Alike for ranks that write as many tensors: metadata, not bytes, is the point.
        staged = Staging().snapshot(local.tensors)
        snap = ShardSnap(local, staged, None)
        ShardedLayout(r, world, StoreReceipts(client, world)).write_own(store, 1, snap, 1)


def run_commit_and_resume(
    world: int, names: list[str], latency_ms: float, layout: str = "fsdp"
) -> list[Row]:
    """commit, resume-checks and resume-plan share one checkpoint of ``world`` ranks. The ranks'
    writes (no latency: ranks write in parallel) are spread over this machine's cores."""
    import torch.distributed as dist

    root = tempfile.mkdtemp(prefix="et-scale-")
    url = f"throttled://{root}"
    job_store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timedelta(seconds=300), wait_for_workers=False
    )
    port = job_store.port
    try:
        workers = min(os.cpu_count() or 1, max(1, world // 256))
        if workers > 1:
            step = -(-world // workers)
            spans = [range(a, min(world, a + step)) for a in range(0, world, step)]
            spawn = multiprocessing.get_context("spawn")  # no fork: this process has threads
            with ProcessPoolExecutor(workers, mp_context=spawn) as pool:
                list(
                    pool.map(
                        _write_ranks,
                        [url] * len(spans),
                        [world] * len(spans),
                        spans,
                        [len(names)] * len(spans),
                        [port] * len(spans),
                        [layout] * len(spans),
                    )
                )
        else:
            _write_ranks(url, world, range(world), len(names), port, layout)
        store = storage.CheckpointStore(url)
        tensors = {n: torch.zeros(1, 2) for n in names}
        local = _shards_of(0, world, names, tensors, layout)
        staged = Staging().snapshot(local.tensors)
        common = Staging().snapshot({"step": 1})
        receipts = _receipts_client(port)
        rows = [_timed_commit(store, world, local, staged, common, latency_ms, receipts)]
        rows.append(_timed_checks(store, world, latency_ms))
        rows.append(_timed_plan(store, world, latency_ms))
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


class _Latency:
    """Storage latency on for the timed part only, with its request and byte counts."""

    def __init__(self, latency_ms: float) -> None:
        self.latency_ms = latency_ms

    def __enter__(self):
        os.environ["ET_THROTTLE_LATENCY_MS"] = str(self.latency_ms)
        self.requests0 = sum(throttled_fs.REQUESTS.values())
        self.read0 = throttled_fs.BYTES["read"]
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        os.environ.pop("ET_THROTTLE_LATENCY_MS", None)
        self.requests = sum(throttled_fs.REQUESTS.values()) - self.requests0
        self.read = throttled_fs.BYTES["read"] - self.read0


def _timed_commit(store, world, local, staged, common, latency_ms, receipts) -> Row:
    store_requests: collections.Counter = collections.Counter()
    gather = StoreReceipts(CountingStore(receipts, store_requests, "store"), world)
    layout = ShardedLayout(0, world, gather)
    snap = ShardSnap(local, staged, common)
    with _Latency(latency_ms) as m:
        manifest = layout.commit(
            store,
            1,
            snap,
            1,
            {},
            before_commit=lambda: None,
            abandoned=lambda step: False,
            deadline_s=3600,
        )
    index_bytes = manifest.files[manifest.metadata["index_file"]].size
    index_format = json.loads(bytes(store.read_file(manifest, manifest.metadata["index_file"])))
    # What rank 0 read from the store counts as metadata too (the rank keys outlive the gather).
    keys = [f"{StoreReceipts._prefix(1, 1)}r{r}" for r in range(world)]
    from_store = sum(len(v) for v in receipts.multi_get(keys))
    return Row(
        "commit",
        world,
        m.requests,
        m.read + from_store,
        m.seconds,
        f"index {index_bytes / 1e6:.2f} MB ({index_bytes} B, format "
        f"{index_format['format'].rpartition('/')[2]}); "
        f"the receipts: {store_requests['store']} store requests",
    )


def _timed_checks(store, world, latency_ms) -> Row:
    with _Latency(latency_ms) as m:
        manifest = next(iter(store.ranked_manifests()))
        store.check_sizes(manifest)
    return Row("resume-checks", world, m.requests, m.read, m.seconds)


class _LocalRows:
    """What a DTensor of rank ``rank`` at world size ``world`` tells DCP about its local chunk."""

    def __init__(self, size: list[int], world: int, rank: int) -> None:
        first, count = sharded.rows_of(size[0], world, rank)
        self.chunk = (torch.Size([first, *[0] * (len(size) - 1)]), torch.Size([count, *size[1:]]))

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(*self.chunk)]


def _timed_plan(store, world, latency_ms) -> Row:
    """Rank 0 at 3W/4: the index read, the runner's ``Index.metadata`` for its targets, then the
    read items of each tensor from DCP's ``create_read_items_for_chunk_list``, which is what
    ``DefaultLoadPlanner`` runs for a DTensor (DTensors of 3W/4 ranks cannot be built here)."""
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    new_world, rank = max(1, world * 3 // 4), 0
    with _Latency(latency_ms) as m:
        manifest = store.read_manifest(1)
        index = Index.parse(store.read_file(manifest, manifest.metadata["index_file"]), "scale")
        targets = {
            fqn: _LocalRows(t["size"], new_world, rank) for fqn, t in index.doc["tensors"].items()
        }
        metadata = index.metadata(targets)
        reads = sum(
            len(create_read_items_for_chunk_list(fqn, meta, targets[fqn].__create_chunk_list__()))
            for fqn, meta in metadata.state_dict_metadata.items()
        )
    return Row(
        "resume-plan",
        world,
        m.requests,
        m.read,
        m.seconds,
        f"rank 0 of {new_world}: {reads} read items",
    )


# -- the run ---------------------------------------------------------------------------------------

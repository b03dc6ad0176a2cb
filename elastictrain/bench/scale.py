"""``bench scale``: the real protocol code for W simulated ranks in this one process, W up to 8,192.

What grows with the number of ranks is metadata and requests, not bytes of state, so every rank
here holds a tiny shard of each of T tensors (``--tensors``, 3,000 by default: a 70B-like layer
count of weights and two moments, each split by rows over the W ranks, as FSDP2's ``Shard(0)``
does). Storage is ``throttled://`` with a latency per request (``--latency-ms``), which counts
requests as S3 bills them. Each phase runs the functions the runner calls:

- **handshake**: W threads, each its own client of one real TCPStore on loopback, through
  ``elastictrain.handshake``; the time from the first rank starting to the last admitted.
- **commit**: W ranks write their shard and table and post their receipt to a real TCPStore
  (``ShardedLayout.write_own``, no latency: ranks write in parallel), then rank 0's
  ``ShardedLayout.commit`` with latency: the critical path after the slowest shard is durable, the
  storage requests it makes, the metadata bytes it reads, and its store requests.
- **resume-checks**: what rank 0 does before anyone reads: rank the manifests, then
  ``CheckpointStore.check_sizes`` of the newest.
- **resume-plan**: one rank at world size 3W/4 reads the index (``shard_reader.Index``) and plans
  its reads with DCP's own per-tensor planner (``create_read_items_for_chunk_list``, what
  ``DefaultLoadPlanner`` runs for a DTensor).

A phase whose next W would take longer than ``--budget-s`` by its measured growth is not run there;
its row says so. The growth exponent is the least-squares slope of log(figure) on log(W).
"""

from __future__ import annotations

import collections
import json
import math
import multiprocessing
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch

import storage
from elastictrain.bench import throttled_fs
from elastictrain.checkpoint.sharded import format as sharded
from elastictrain.checkpoint.sharded.reader import Index
from elastictrain.checkpoint.state.flat import Staging
from elastictrain.checkpoint.write.layouts import ShardedLayout, ShardSnap
from elastictrain.checkpoint.write.receipts import StoreReceipts
from elastictrain.env import DistEnv
from elastictrain.handshake import handshake

WORLDS = (8, 64, 512, 4096, 8192)
PHASES = ("handshake", "commit", "resume-checks", "resume-plan")


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
def _tensor_names(count: int) -> list[str]:
    kinds = ("model", "optimizer.exp_avg", "optimizer.exp_avg_sq")
    return [f"{kinds[i % 3]}.layers.{i // 3}.weight" for i in range(count)]


def _shards_of(rank: int, world: int, names: list[str], tensors: dict) -> sharded.LocalShards:
    """Rank ``rank``'s chunks under ``Shard(0)``: one row of a (world, 2) float32 tensor each."""
    chunks = [
        {"fqn": n, "dtype": "float32", "size": [world, 2], "offsets": [rank, 0], "sizes": [1, 2]}
        for n in names
    ]
    return sharded.LocalShards(tensors, chunks)


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
        rank=rank, world_size=world, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
        master_port=port, restart_count=0, max_restarts=0, run_id="scale", use_agent_store=True,
        launched_by_torchrun=True,
    )  # fmt: skip


def run_handshake(world: int) -> Row:
    import torch.distributed as dist

    timeout = timedelta(seconds=300)
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
    t0 = time.perf_counter()
    # Connected first, 64 at a time: some of torch's client connects stall for 5 s under a burst
    # (docs/scale.md), which would otherwise dominate the harness, not the protocol.
    with ThreadPoolExecutor(64) as pool:
        clients = list(pool.map(
            lambda _: dist.TCPStore("127.0.0.1", server.port, None, False, timeout), range(world)
        ))  # fmt: skip
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
    return Row("handshake", world, total, None, max(done) - t0,
               f"{total / world:.1f} requests/rank; all joined (rank 0 done) at "
               f"{done[0] - t0:.2f}s, the threads started by {started_s:.2f}s; {world} "
               f"connects took {connect_s:.1f}s before, untimed")  # fmt: skip


def _receipts_client(port: int) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=300))


def _write_ranks(url: str, world: int, ranks: range, tensor_count: int, port: int) -> None:
    """Ranks ``ranks``' shard, table and receipt, as ``ShardedLayout.write_own`` writes them, the
    receipts into the job's store at ``port`` (one connection for these ranks: a client per rank
    changes nothing the commit does, and 8,192 connects would dominate the harness)."""
    names = _tensor_names(tensor_count)
    tensors = {n: torch.zeros(1, 2) for n in names}
    staged = Staging().snapshot(tensors)  # the same bytes for every rank: metadata is the point
    store = storage.CheckpointStore(url)
    client = _receipts_client(port)
    for r in ranks:
        snap = ShardSnap(_shards_of(r, world, names, tensors), staged, None)
        ShardedLayout(r, world, StoreReceipts(client, world)).write_own(store, 1, snap, 1)


def run_commit_and_resume(world: int, names: list[str], latency_ms: float) -> list[Row]:
    """commit, resume-checks and resume-plan share one checkpoint of ``world`` ranks. The ranks'
    writes (no latency: ranks write in parallel) are spread over this machine's cores."""
    import torch.distributed as dist

    root = tempfile.mkdtemp(prefix="et-scale-")
    url = f"throttled://{root}"
    job_store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=300),
                              wait_for_workers=False)  # fmt: skip
    port = job_store.port
    try:
        workers = min(os.cpu_count() or 1, max(1, world // 256))
        if workers > 1:
            step = -(-world // workers)
            spans = [range(a, min(world, a + step)) for a in range(0, world, step)]
            spawn = multiprocessing.get_context("spawn")  # no fork: this process has threads
            with ProcessPoolExecutor(workers, mp_context=spawn) as pool:
                list(pool.map(_write_ranks, [url] * len(spans), [world] * len(spans), spans,
                              [len(names)] * len(spans), [port] * len(spans)))  # fmt: skip
        else:
            _write_ranks(url, world, range(world), len(names), port)
        store = storage.CheckpointStore(url)
        tensors = {n: torch.zeros(1, 2) for n in names}
        staged = Staging().snapshot(tensors)
        common = Staging().snapshot({"step": 1})
        receipts = _receipts_client(port)
        rows = [_timed_commit(store, world, names, tensors, staged, common, latency_ms, receipts)]
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


def _timed_commit(store, world, names, tensors, staged, common, latency_ms, receipts) -> Row:
    store_requests: collections.Counter = collections.Counter()
    gather = StoreReceipts(CountingStore(receipts, store_requests, "store"), world)
    layout = ShardedLayout(0, world, gather)
    snap = ShardSnap(_shards_of(0, world, names, tensors), staged, common)
    with _Latency(latency_ms) as m:
        manifest = layout.commit(store, 1, snap, 1, {}, before_commit=lambda: None,
                                 abandoned=lambda step: False, deadline_s=3600)  # fmt: skip
    index_bytes = manifest.files[manifest.metadata["index_file"]].size
    # What rank 0 read from the store counts as metadata too (the rank keys outlive the gather).
    keys = [f"{StoreReceipts._prefix(1, 1)}r{r}" for r in range(world)]
    from_store = sum(len(v) for v in receipts.multi_get(keys))
    return Row("commit", world, m.requests, m.read + from_store, m.seconds,
               f"index {index_bytes / 1e6:.2f} MB; the receipts: {store_requests['store']} store "
               f"requests")  # fmt: skip


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
        targets = {fqn: _LocalRows(t["size"], new_world, rank)
                   for fqn, t in index.doc["tensors"].items()}  # fmt: skip
        metadata = index.metadata(targets)
        reads = sum(
            len(create_read_items_for_chunk_list(fqn, meta, targets[fqn].__create_chunk_list__()))
            for fqn, meta in metadata.state_dict_metadata.items()
        )
    return Row("resume-plan", world, m.requests, m.read, m.seconds,
               f"rank 0 of {new_world}: {reads} read items")  # fmt: skip


# -- the run ---------------------------------------------------------------------------------------
def growth(rows: list[Row], field: str) -> float | None:
    """Least-squares slope of log(figure) on log(W): 0 flat, 1 linear, 2 quadratic."""
    pts = [(math.log(r.world), math.log(v)) for r in rows if (v := getattr(r, field))]
    if len(pts) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return round(sum((x - mx) * (y - my) for x, y in pts) / sxx, 2) if sxx else None


def _raise_open_files(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need <= hard or (hard == resource.RLIM_INFINITY and soft < need):
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def measure(worlds, latency_ms: float, tensors: int, budget_s: float, phases=PHASES) -> list[Row]:
    names = _tensor_names(tensors)
    rows: list[Row] = []
    last: dict[str, tuple[int, float]] = {}  # phase -> (W, seconds) of its last run

    def too_slow(phase: str, world: int) -> str | None:
        if phase not in last:
            return None
        w, s = last[phase]
        expected = s * (world / w) ** max(1.0, growth_of(phase) or 1.0)
        return (
            f"not run: ~{expected:.0f}s expected > --budget-s {budget_s:.0f}"
            if expected > budget_s
            else None
        )

    def growth_of(phase: str) -> float | None:
        return growth([r for r in rows if r.phase == phase and r.seconds], "seconds")

    for world in worlds:
        if "handshake" in phases:
            skip = too_slow("handshake", world)
            _raise_open_files(2 * world + 256)
            row = Row("handshake", world, note=skip) if skip else run_handshake(world)
            rows.append(row)
            if not skip:
                last["handshake"] = (world, row.seconds)
        storage_phases = [p for p in ("commit", "resume-checks", "resume-plan") if p in phases]
        if storage_phases:
            skip = too_slow("commit", world)
            if skip:
                rows += [Row(p, world, note=skip) for p in storage_phases]
                continue
            t0 = time.perf_counter()
            got = run_commit_and_resume(world, names, latency_ms)
            rows += [r for r in got if r.phase in storage_phases]
            last["commit"] = (world, time.perf_counter() - t0)
    return rows


def render(rows: list[Row], latency_ms: float, tensors: int) -> str:
    out = [f"bench scale: {tensors} tensors, {latency_ms:g} ms per storage request",
           f"{'phase':<14} {'W':>6} {'requests':>9} {'metadata':>12} {'seconds':>9}  note"]  # fmt: skip
    for r in rows:
        req = "-" if r.requests is None else str(r.requests)
        meta = "-" if r.metadata_bytes is None else f"{r.metadata_bytes / 1e6:.2f} MB"
        sec = "-" if r.seconds is None else f"{r.seconds:.3f}"
        out.append(f"{r.phase:<14} {r.world:>6} {req:>9} {meta:>12} {sec:>9}  {r.note}")
    out.append("growth exponent in W (0 flat, 1 linear), from the rows that ran:")
    for phase in dict.fromkeys(r.phase for r in rows):
        mine = [r for r in rows if r.phase == phase and r.seconds is not None]
        figures = {f: growth(mine, f) for f in ("requests", "metadata_bytes", "seconds")}
        out.append(f"  {phase:<14} " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    return "\n".join(out)


def main(worlds, latency_ms: float, tensors: int, budget_s: float, as_json: bool) -> int:
    rows = measure(worlds, latency_ms, tensors, budget_s)
    if as_json:
        print(json.dumps({"latency_ms": latency_ms, "tensors": tensors,
                          "rows": [asdict(r) for r in rows]}))  # fmt: skip
    else:
        print(render(rows, latency_ms, tensors))
    return 0

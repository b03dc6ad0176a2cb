"""Durable reads shared by the ranks that need the same bytes: HSDP's replicas.

Under HSDP every shard position has R replicas, and all R resume the same shards. Read alone, a
job would read R x its state from the durable tier. Instead the ranks whose wanted byte ranges are
the same ("twins", found by one all-gather of a 64-bit digest per rank) share the reading:

- the wanted bytes are cut at block boundaries into R runs of about equal size, so no block is
  read (or verified) twice;
- each twin reads its run from the store, block-verified, and sends it to the others over the
  checkpoint's process group;
- each twin puts the runs together into the ranges it planned, and DCP's reader copies them in.

A rank without twins (FSDP, DDP, a move between layouts where no two ranks want the same bytes)
reads its own ranges straight from the store, as before, with no extra copy.

Failure stays the durable path's: a run that did not verify is sent as "none", every twin takes
every message off the wire before it raises, and the caller's agreement moves every rank to the
next older step. A rank that could not plan (its index or a table did not verify) joins the
all-gather with digest 0 and shares with no one.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist

import storage
from elastictrain.cluster.collectives import as_bytes_tensor

Range = tuple[int, int]
Wanted = dict[str, tuple[list[str], tuple[Range, ...]]]
"""Per shard file: (its block digests, the byte ranges a rank reads of it)."""


class SharedRanges:
    """A store for the sharded reader: files from the durable store, byte ranges from what this
    rank and its twins read (or, with no twins, from the store as they are asked for)."""

    def __init__(self, store: storage.VerifiedFiles) -> None:
        self.store, self.safe_url = store, store.safe_url
        self.ranges: dict[tuple[str, Range], memoryview] = {}
        self.bytes_read = 0
        """Bytes this rank read from the store itself (its run, or all it needs)."""
        self.twins: list[int] = []

    def read_file(self, manifest: storage.Manifest, name: str):
        return self.store.read_file(manifest, name)

    def read_ranges(self, manifest, name, blocks, ranges):
        if not self.ranges:
            views, n = self.store.read_ranges(manifest, name, blocks, ranges)
            self.bytes_read += n
            return views, 0
        return {r: self.ranges[(name, r)] for r in ranges}, 0


def fetch(
    store: storage.VerifiedFiles,
    manifest: storage.Manifest,
    wanted: Wanted | None,
    *,
    group: dist.ProcessGroup | None,
    rank: int,
) -> SharedRanges:
    """Every rank together: the ranges of ``wanted`` (None: this rank could not plan), read once
    among the ranks that want the same. Raises CheckpointCorruptError on each twin of a rank whose
    run did not verify, after the exchange."""
    shared = SharedRanges(store)
    key = _digest(wanted) if wanted is not None else 0
    keys = _all_gather_int(key, group)
    shared.twins = [q for q, k in enumerate(keys) if k and k == key]
    if len(shared.twins) < 2:
        return shared
    runs = _runs(manifest, wanted, len(shared.twins))
    me = shared.twins.index(rank)
    mine, error = None, None
    try:
        mine = _read_run(store, manifest, wanted, runs[me], shared)
    except storage.CheckpointCorruptError as e:
        error = e
    got = _swap(mine, me, shared.twins, [_run_bytes(r) for r in runs], group)
    if error is not None:
        raise error
    failed = [shared.twins[i] for i, data in enumerate(got) if data is None]
    if failed:
        raise storage.CheckpointCorruptError(
            f"Checkpoint step {manifest.step} under {store.safe_url!r}: rank(s) {failed} could "
            "not read their share of the bytes this rank needs (their logs name the file)."
        )
    _assemble(shared, wanted, runs, got)
    return shared


def _digest(wanted: Wanted) -> int:
    """A nonzero signed 64-bit digest of the ranges a rank wants."""
    doc = json.dumps({n: r for n, (_, r) in sorted(wanted.items())}, separators=(",", ":"))
    value = int.from_bytes(hashlib.sha256(doc.encode()).digest()[:8], "little", signed=True)
    return value or 1


def _all_gather_int(value: int, group: dist.ProcessGroup | None) -> list[int]:
    """Every rank's ``value``: one tensor all-gather, 8 bytes a rank."""
    if group is None:
        return [value]
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, torch.tensor([value], dtype=torch.int64), group=group)
    return [int(t.item()) for t in out]


Run = list[tuple[str, Range]]
"""A twin's share: (file, byte range) pieces, in order."""


def _runs(manifest: storage.Manifest, wanted: Wanted, n: int) -> list[Run]:
    """The wanted bytes cut into ``n`` runs of about equal size, at block boundaries (each block
    in one run), files in name order; the same on every twin."""
    blocks: list[tuple[str, list[Range]]] = []  # (file, the wanted pieces within one block)
    for name, (_, ranges) in sorted(wanted.items()):
        size = manifest.files[name].block_size
        by_block: dict[int, list[Range]] = {}
        for lo, hi in sorted(ranges):
            at = lo
            while at < hi:
                b = at // size
                end = min(hi, (b + 1) * size)
                by_block.setdefault(b, []).append((at, end))
                at = end
        blocks += [(name, pieces) for _, pieces in sorted(by_block.items())]
    total = sum(hi - lo for _, pieces in blocks for lo, hi in pieces)
    runs: list[Run] = [[] for _ in range(n)]
    done = 0
    for name, pieces in blocks:
        weight = sum(hi - lo for lo, hi in pieces)
        # The run whose part of the bytes holds the block's middle: a few large blocks still
        # spread (a small job's shard file is one block).
        share = min(n - 1, (2 * done + weight) * n // (2 * total)) if total else 0
        runs[share] += [(name, p) for p in pieces]
        done += weight
    return runs


def _run_bytes(run: Run) -> int:
    return sum(hi - lo for _, (lo, hi) in run)


def _read_run(
    store: storage.VerifiedFiles,
    manifest: storage.Manifest,
    wanted: Wanted,
    run: Run,
    shared: SharedRanges,
) -> bytearray:
    """This twin's run, read and verified, as one buffer."""
    out, by_file = bytearray(), {}
    for name, piece in run:
        by_file.setdefault(name, []).append(piece)
    views = {}
    for name, pieces in by_file.items():
        got, n = store.read_ranges(manifest, name, wanted[name][0], pieces)
        shared.bytes_read += n
        views.update({(name, p): v for p, v in got.items()})
    for name, piece in run:
        out += views[(name, piece)]
    return out


def _swap(mine: bytearray | None, me: int, twins: list[int], sizes: list[int], group) -> list[Any]:
    """Each twin's run, this one's included; None for a twin whose read failed. Sends are posted
    first on every twin, so nobody waits on a peer that is itself waiting to send."""
    flag = torch.tensor([0 if mine is not None else -1], dtype=torch.int64)
    sends = []
    for q in twins:
        if q != twins[me]:
            sends.append(dist.isend(flag, q, group=group))
            if mine is not None and len(mine):
                sends.append(dist.isend(as_bytes_tensor(mine), q, group=group))
    got: list[Any] = []
    for i, q in enumerate(twins):
        if i == me:
            got.append(mine)
            continue
        status = torch.zeros(1, dtype=torch.int64)
        dist.recv(status, q, group=group)
        if int(status.item()) < 0:
            got.append(None)
            continue
        data = bytearray(sizes[i])
        if data:
            dist.recv(as_bytes_tensor(data), q, group=group)
        got.append(data)
    for work in sends:
        work.wait()
    return got


def _assemble(shared: SharedRanges, wanted: Wanted, runs: list[Run], got: list[Any]) -> None:
    """The planned ranges, put together from the twins' runs (a range may span two runs)."""
    by_file: dict[str, list[tuple[int, int, memoryview]]] = {}
    for run, data in zip(runs, got, strict=True):
        view, at = memoryview(data), 0
        for name, (lo, hi) in run:
            by_file.setdefault(name, []).append((lo, hi, view[at : at + hi - lo]))
            at += hi - lo
    for name, (_, ranges) in wanted.items():
        pieces = sorted(by_file.get(name, []), key=lambda p: p[:2])
        starts = [lo for lo, _, _ in pieces]
        for lo, hi in ranges:
            buf = bytearray(hi - lo)
            i = max(0, bisect.bisect_right(starts, lo) - 1)
            while i < len(pieces) and pieces[i][0] < hi:
                a, b, v = pieces[i]
                if b > lo:
                    s, e = max(a, lo), min(b, hi)
                    buf[s - lo : e - lo] = v[s - a : e - a]
                i += 1
            shared.ranges[(name, (lo, hi))] = memoryview(buf)

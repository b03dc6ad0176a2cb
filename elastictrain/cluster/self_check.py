"""Nodes checked before they train: at every start each rank runs a short, bounded self-check,
the findings are gathered, and every rank judges them the same way (:func:`judge`). A node that
fails is left out (``train.training``: in place, or through torchrun's re-rendezvous); when the
job cannot go on without it, every rank stops with exit 2 and the reason. A spare node checks
itself again when it is called to take a lost node's place (``inplace.spares``).

The checks (``--no-self-check`` skips them):

- **Compute.** A product of two integer-valued float32 matrices on the rank's device. Every entry
  of the inputs and of the product is a small integer, so any correct device computes it
  exactly, in any summation order (TF32 too): every healthy rank's product is the same, bit for
  bit. A rank fails when its product fails Freivalds' check against the exact product (``C x``
  against ``A (B x)`` in float64 on the CPU, with ``x`` nonzero everywhere, so a single wrong
  entry always shows), or when its digest differs from the one most ranks on the same kind of
  device computed (the cross-node comparison: several wrong entries that happen to cancel).
  Exact, so it judges a one-node job too, and a job where half the nodes are bad.
- **The job's store.** The median of 5 set+get round trips, on each node's local rank 0. It
  fails above one heartbeat (``--heartbeat-seconds``): liveness beats through this store, and a
  node whose round trip is longer than a beat would soon be found silent mid-step.
- **Room for the node-memory tier** (the rank that writes a node's replicated copy, when the
  tier is on; the sharded tier checks its room at its first copy): the folder's free bytes
  against the tier's own need (3 copies of the state at the check). A node short of room
  fails only where another node has it (a full ``/dev/shm`` on one host); when every node is
  short, the tier turns itself off at its first copy, as it always has, and no node fails.
- **The checkpoint storage** is the multi-node preflight's (``checkpoint.write.node_check``):
  every node must see rank 0's location, or the job stops with exit 2 before any state is
  loaded.

Cost at a start: one product (256 x 256 on the CPU, about 2 ms; 4096 x 4096 on a GPU), 10 store
requests per node, one all-gather of a small object.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import xxhash

from elastictrain import knobs

logger = logging.getLogger(__name__)

SEED = 46  # the inputs are the same on every rank of every job
ROUND_TRIPS = 5


def product_size(device: torch.device) -> int:
    """The matrices' side: small on the CPU (every start of a CPU job pays it, the test suite's
    hundreds of processes too), large enough on a GPU to run on its tensor cores' paths."""
    return 4096 if device.type == "cuda" else 256


@dataclass(frozen=True)
class Findings:
    """One rank's self-check, as gathered."""

    rank: int
    node: int
    host: str
    serves_store: bool
    size: int
    """The product's side (its digest is compared only with ranks of the same size)."""
    digest: str
    exact: bool
    compute_s: float
    store_rtt_s: float | None = None
    """Local rank 0 only: the median round trip to the job's store."""
    tier_free: int | None = None
    tier_need: int | None = None
    """Local rank 0 with the node-memory tier on: the folder's free bytes and the tier's need."""


def compute_check(device: torch.device) -> tuple[int, str, bool, float]:
    """(size, the product's digest, whether it is exact, seconds on the device)."""
    n = product_size(device)
    gen = torch.Generator().manual_seed(SEED)
    a = torch.randint(-4, 5, (n, n), generator=gen).to(torch.float32)
    b = torch.randint(-4, 5, (n, n), generator=gen).to(torch.float32)
    signs = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
    x = (torch.randint(1, 5, (n,), generator=gen) * signs).to(torch.float64)  # no zero entry
    t0 = time.monotonic()
    product = a.to(device) @ b.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.monotonic() - t0
    product = product.cpu()
    if knobs.unhealthy() == "compute":  # chaos unhealthy-node: a device that computes wrong
        product.view(torch.int32)[n // 3, n // 5] ^= 1
    digest = xxhash.xxh3_64_hexdigest(product.numpy().tobytes())
    # |entries| stay below 2^31 for n <= 4096, so float64 holds both sides exactly.
    exact = torch.equal(product.to(torch.float64) @ x, a.double() @ (b.double() @ x))
    return n, digest, exact, seconds


def store_round_trip(store, key: str) -> float:
    """The median seconds of ``ROUND_TRIPS`` set+get round trips to ``store`` (``key``: this
    node's own, deleted after)."""
    times = []
    for i in range(ROUND_TRIPS):
        t0 = time.monotonic()
        store.set(key, str(i))
        store.get(key)
        times.append(time.monotonic() - t0)
    store.delete_key(key)
    return statistics.median(times)


def tier_room(folder: str, need: int) -> tuple[int, int]:
    """(free bytes where the node-memory tier writes, the bytes it needs)."""
    return shutil.disk_usage(folder).free, need


def examine(
    device: torch.device,
    *,
    rank: int,
    node: int,
    host: str,
    serves_store: bool,
    store=None,
    room: Callable[[], tuple[int, int] | None] | None = None,
) -> Findings:
    """This rank's findings. ``store``: given on a node's local rank 0 (the round trips);
    ``room``: the node-memory tier's (free, need), None when it is off."""
    size, digest, exact, seconds = compute_check(device)
    # Keyed by rank, not node alone: two processes that both take themselves for a node's first
    # (ranks that play nodes on one host) would share the key, and one's delete left the other's
    # get blocked on a key no one sets again (the shard-tier probe hung there, 3 times in CI).
    key = f"elastictrain/self-check/{node}/{rank}"
    rtt = store_round_trip(store, key) if store is not None else None
    free, need = (room() or (None, None)) if room is not None else (None, None)
    return Findings(rank, node, host, serves_store, size, digest, exact, seconds, rtt, free, need)


def spare_check(
    device: torch.device, *, node: int, store=None, rtt_limit_s: float | None = None
) -> str | None:
    """A spare node's rank, before it stands by and again when it is called to take a place: why
    it fails, or None. The compute check is judged against the exact product alone (no other
    rank's is at hand; every healthy one equals it), and ``store`` (local rank 0) is timed as a
    training node's is."""
    _, _, exact, _ = compute_check(device)
    if not exact:
        return (
            "its compute check is wrong: a product of two integer matrices that differs from "
            "the exact one (a device that computes wrong)"
        )
    if store is not None and rtt_limit_s is not None:
        # A key of its own, as ``examine``'s: never one another process deletes under it.
        rtt = store_round_trip(store, f"elastictrain/self-check/{node}/spare-{os.getpid()}")
        if rtt > rtt_limit_s:
            return (
                f"a round trip to the job's store takes {rtt:.2f}s, more than one heartbeat "
                f"({rtt_limit_s:g}s, --heartbeat-seconds)"
            )
    return None


def judge(findings: list[Findings], *, rtt_limit_s: float) -> dict[int, list[str]]:
    """Each failing node's reasons, by node (empty: every node passed). The same on every rank:
    it reads the gathered findings only."""
    common = {}
    for size in {f.size for f in findings}:
        digests = Counter(f.digest for f in findings if f.size == size)
        common[size] = digests.most_common(1)[0][0]
    has_room = any(f.tier_need is not None and f.tier_free >= f.tier_need for f in findings)
    wrong: dict[int, list[int]] = {}
    differs: dict[int, list[int]] = {}
    failed: dict[int, list[str]] = {}
    for f in findings:
        if not f.exact:
            wrong.setdefault(f.node, []).append(f.rank)
        elif f.digest != common[f.size]:
            differs.setdefault(f.node, []).append(f.rank)
        reasons = failed.setdefault(f.node, [])
        if f.store_rtt_s is not None and f.store_rtt_s > rtt_limit_s:
            reasons.append(
                f"a round trip to the job's store takes {f.store_rtt_s:.2f}s, more than one "
                f"heartbeat ({rtt_limit_s:g}s, --heartbeat-seconds) (host {f.host})"
            )
        if f.tier_need is not None and f.tier_free < f.tier_need and has_room:
            reasons.append(
                f"the node-memory tier has {f.tier_free >> 20} MiB free and needs "
                f"{f.tier_need >> 20} MiB, which other nodes have (host {f.host})"
            )
    hosts = {f.node: f.host for f in findings}
    for node, ranks in wrong.items():
        failed[node].insert(
            0,
            f"the compute check of rank(s) {_ranks(ranks)} (host {hosts[node]}) is wrong: a "
            "product of two integer matrices that differs from the exact one (a device that "
            "computes wrong)",
        )
    for node, ranks in differs.items():
        failed[node].insert(
            0,
            f"the compute check of rank(s) {_ranks(ranks)} (host {hosts[node]}) differs from "
            "the product most ranks computed",
        )
    return {node: reasons for node, reasons in failed.items() if reasons}


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def summary(findings: list[Findings]) -> dict:
    """The ``self_check`` event's evidence: every rank's findings."""
    return {"findings": [asdict(f) for f in findings]}


@dataclass(frozen=True)
class LeftOut:
    """Rank 0's decision on a start's self-check, every rank's once broadcast."""

    failed: dict[int, list[str]]
    """Each failing node's reasons, by node."""
    ranks: list[int]
    """The failing nodes' ranks (the epoch's)."""
    how: str
    """``in place`` (the others regroup without them, a spare node taking their places if one
    stands by), ``restart`` (torchrun re-forms the group without them), or ``stop`` (exit 2)."""
    why_stop: str | None = None

    def describe(self) -> str:
        reasons = "; ".join(
            f"node {node}: {', '.join(why)}" for node, why in sorted(self.failed.items())
        )
        after = {
            "in place": "the others go on without it, in place",
            "restart": "it leaves the job, and torchrun re-forms the group without it",
            "stop": f"the job cannot go on without it ({self.why_stop})",
        }[self.how]
        return f"{len(self.failed)} node(s) failed the self-check: {reasons}; {after}"


def decide(
    failed: dict[int, list[str]],
    findings: list[Findings],
    *,
    in_place: bool,
    floor: int,
    spares_ready: int = 0,
    movable: bool = True,
    restarts_left: int = 0,
) -> LeftOut:
    """Whether the job goes on without the failing nodes, and how. ``floor``: the fewest training
    nodes it may train on; ``spares_ready``: spare nodes standing by (each takes a failed node's
    place in place); ``restarts_left``: torchrun's, for the way without ``--replace-in-place``."""
    nodes = {f.node for f in findings}
    ranks = sorted(f.rank for f in findings if f.node in failed)
    left = len(nodes) - len(failed) + (min(spares_ready, len(failed)) if in_place else 0)
    why = None
    if any(f.serves_store for f in findings if f.node in failed):
        why = (
            "a failing node serves the job's rendezvous store, which every other node needs "
            "(put --rdzv-endpoint off the training nodes: docs/faults.md)"
        )
    elif left < max(1, floor):
        why = f"it would leave {left} training node(s), below the minimum {max(1, floor)}"
    elif in_place and not movable:
        why = "the data stream's per-rank positions cannot move in place"
    elif not in_place and restarts_left < 1:
        why = "torchrun has no restart left to re-form the group without it (--max-restarts)"
    how = "stop" if why else ("in place" if in_place else "restart")
    return LeftOut(failed, ranks, how, why)


def check_or_stop(
    device: torch.device, env, *, store, group, rtt_limit_s: float, serves_store: bool = False
) -> None:
    """Library mode's self-check (``init_distributed``): every rank's findings gathered and
    judged; a failing node stops every rank (``SelfCheckFailedError``, exit 2) naming each reason,
    since nothing there can leave a node out before the user's loop has its state."""
    import socket

    from elastictrain.cluster.collectives import all_gather_object
    from elastictrain.errors import SelfCheckFailedError

    mine = examine(
        device,
        rank=env.rank,
        node=env.node_rank,
        host=socket.gethostname(),
        serves_store=serves_store,
        store=store if env.local_rank == 0 else None,
    )
    failed = judge(all_gather_object(mine, group), rtt_limit_s=rtt_limit_s)
    if failed:
        reasons = "; ".join(f"node {n}: {', '.join(why)}" for n, why in sorted(failed.items()))
        raise SelfCheckFailedError(
            f"{len(failed)} node(s) failed the self-check: {reasons}. Fix or replace the "
            "node(s), or relaunch without them; init_distributed(self_check=False) skips it."
        )

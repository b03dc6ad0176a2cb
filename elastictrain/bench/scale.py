"""``bench scale``: the real protocol code for W simulated ranks in this one process, W up to 8,192.

What grows with the number of ranks is metadata and requests, not bytes of state, so every rank
here holds a tiny shard of each of T tensors (``--tensors``, 3,000 by default: a 70B-like layer
count of weights and two moments, each split by rows over the W ranks, as FSDP2's ``Shard(0)``
does). Storage is ``throttled://`` with a latency per request (``--latency-ms``), which counts
requests as S3 bills them. Each phase runs the functions the runner calls:

- **handshake**: W threads, each its own client of one real TCPStore on loopback, through
  ``elastictrain.cluster.handshake``; the time from the first rank starting to the last admitted.
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

import json
import math
import resource
import time
from dataclasses import asdict

from elastictrain.bench.scale_phases import (
    Row,
    run_commit_and_resume,
    run_handshake,
    tensor_names,
)

WORLDS = (8, 64, 512, 4096, 8192)
PHASES = ("handshake", "commit", "resume-checks", "resume-plan")


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


def measure(
    worlds, latency_ms: float, tensors: int, budget_s: float, phases=PHASES, layout: str = "fsdp"
) -> list[Row]:
    names = tensor_names(tensors)
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
            got = run_commit_and_resume(world, names, latency_ms, layout)
            rows += [r for r in got if r.phase in storage_phases]
            last["commit"] = (world, time.perf_counter() - t0)
    return rows


def render(rows: list[Row], latency_ms: float, tensors: int, layout: str = "fsdp") -> str:
    out = [
        f"bench scale: {tensors} tensors ({layout}), {latency_ms:g} ms per storage request",
        f"{'phase':<14} {'W':>6} {'requests':>9} {'metadata':>12} {'seconds':>9}  note",
    ]
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


def main(
    worlds, latency_ms: float, tensors: int, budget_s: float, as_json: bool, layout: str = "fsdp"
) -> int:
    # The handshake does not depend on the layout: the grid layouts time the storage phases.
    phases = PHASES if layout == "fsdp" else PHASES[1:]
    rows = measure(worlds, latency_ms, tensors, budget_s, phases, layout)
    if as_json:
        doc = {
            "latency_ms": latency_ms,
            "tensors": tensors,
            "layout": layout,
            "rows": [asdict(r) for r in rows],
        }
        print(json.dumps(doc))
    else:
        print(render(rows, latency_ms, tensors, layout))
    return 0

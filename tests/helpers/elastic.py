"""Simulated nodes: one torchrun agent each, sharing a c10d rendezvous on loopback."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

# Fast failure detection for tests: 1 s heartbeats, 3 missed = dead; 1 s last call for stragglers.
# Production values are in the README (torchrun's defaults: 5 s heartbeats, 30 s last call).
TEST_RDZV_CONF = "last_call_timeout=1,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=3,close_timeout=5"


def node_args(
    port: int,
    run_id: str,
    *,
    is_host: bool,
    max_restarts: int = 6,
    nnodes: str = "1:3",
    nproc: int = 1,
) -> list[str]:
    """torchrun flags for one simulated node.

    ``is_host`` must be explicit when several agents share one machine: each agent otherwise infers
    "the endpoint is my hostname, so I host the store", and a second TCPStore server can bind the
    same loopback port, splitting the rendezvous in two (both sides then time out after 60 s).
    """
    return [
        f"--nnodes={nnodes}",
        f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        f"--max-restarts={max_restarts}",
        f"--rdzv-conf={TEST_RDZV_CONF},is_host={int(is_host)}",
        "--monitor-interval=0.5",
    ]


def committed_history(entries: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """For each step, the ledger entries of the highest generation that drew it (a skipped
    step's ``skipped`` lines are in :func:`skipped_steps`, not here)."""
    by_step: dict[int, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for e in entries:
        if "skipped" not in e:
            by_step[e["step"]][e["generation"]].append(e)
    return {step: gens[max(gens)] for step, gens in by_step.items()}


def skipped_steps(entries: list[dict[str, Any]]) -> dict[int, str]:
    """The steps whose samples the committed history drew and did not train: step -> reason.
    Every rank of the step's generation recorded the skip (the verdict is every rank's)."""
    history = committed_history(entries)
    skips: dict[int, dict[int, str]] = defaultdict(dict)
    for e in entries:
        drew = history.get(e["step"])
        if "skipped" in e and drew and e["generation"] == drew[0]["generation"]:
            skips[e["step"]][e["rank"]] = e["skipped"]
    for step, by_rank in skips.items():
        world = history[step][0]["world_size"]
        assert sorted(by_rank) == list(range(world)), f"step {step}: skipped by {sorted(by_rank)}"
        assert len(set(by_rank.values())) == 1, f"step {step}: reasons {by_rank}"
    return {step: next(iter(by_rank.values())) for step, by_rank in skips.items()}


def assert_exactly_once(
    entries: list[dict[str, Any]], *, dataset_size: int, batch_size: int, max_steps: int
) -> dict:
    """Every step's global batch drawn once (trained, or recorded as skipped on every rank:
    :func:`skipped_steps`); every full epoch covers its samples exactly once."""
    history = committed_history(entries)
    assert sorted(history) == list(range(max_steps)), "some steps are missing from the ledger"
    steps_per_epoch = dataset_size // batch_size
    per_epoch: dict[int, list[int]] = defaultdict(list)
    micro_batches = set()
    for step, rows in history.items():
        world = rows[0]["world_size"]
        # One row per (rank, micro-batch): every rank once, each with micro-batches 0..k-1 once.
        keys = sorted((r["rank"], r.get("micro", 0)) for r in rows)
        per_rank = len(keys) // world
        micro_batches.add(per_rank)
        assert keys == [(r, m) for r in range(world) for m in range(per_rank)], (
            f"step {step}: {keys}"
        )
        ordered = sorted(rows, key=lambda r: (r["rank"], r.get("micro", 0)))
        indices = [i for r in ordered for i in r["indices"]]
        assert len(indices) == batch_size, f"step {step} trained {len(indices)} samples"
        per_epoch[step // steps_per_epoch].extend(indices)
    full_epochs = max_steps // steps_per_epoch
    for epoch in range(full_epochs):
        samples = per_epoch[epoch]
        assert len(samples) == len(set(samples)), f"epoch {epoch}: duplicates"
        assert len(samples) == steps_per_epoch * batch_size
        if dataset_size % batch_size == 0:
            assert sorted(samples) == list(range(dataset_size)), f"epoch {epoch}: samples missing"
    worlds = sorted({rows[0]["world_size"] for rows in history.values()})
    return {
        "steps": len(history),
        "full_epochs": full_epochs,
        "world_sizes": worlds,
        "micro_batches": sorted(micro_batches),
    }

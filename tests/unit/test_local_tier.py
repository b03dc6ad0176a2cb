"""elastictrain.checkpoint.tiers.local: the node-local tier's folder, schedule and sizing."""

from __future__ import annotations

import os

import torch

from elastictrain.checkpoint.tiers.local import LocalSchedule, default_dir, payload_bytes


def test_one_folder_per_durable_location_without_its_credentials(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = default_dir("./ckpt", "/dev/shm")
    assert a == default_dir(str(tmp_path / "ckpt"), "/dev/shm")  # resolved, as the store does
    assert a.startswith(f"/dev/shm/elastictrain-{os.getuid()}/")
    assert default_dir("s3://b/run", "/r") != default_dir("s3://b/other", "/r")
    key = os.path.basename(default_dir("s3://KEY:SECRET@b/run", "/r"))
    assert len(key) == 16 and int(key, 16) >= 0  # a hash: no URL, let alone its credentials


def test_auto_interval_keeps_the_copies_within_the_overhead_budget():
    schedule = LocalSchedule("auto", overhead=0.02)
    assert not schedule.due(1)  # no step time measured yet
    schedule.step_s = 0.010
    assert schedule.due(7)  # the first copy: it measures the cost
    schedule.took_copy(7, blocked_s=0.0006)
    schedule.excess_s = 0.0004  # the steps it slowed while being written
    schedule.took_copy(8, blocked_s=0.0006)  # 0.001 in all: 10% of a step
    assert schedule.interval() == 5  # 0.001 / (0.02 * 0.010)
    assert not schedule.due(12) and schedule.due(13)
    schedule.cost_s = 0.0  # a copy cheaper than anything: every step, never 0
    assert schedule.interval() == 1
    fixed = LocalSchedule(10, overhead=0.02)
    assert [s for s in range(1, 31) if fixed.due(s)] == [10, 20, 30]


def test_a_copy_costs_its_blocking_plus_the_slowdown_of_the_steps_it_overlaps():
    clock = iter([0.0, 0.1, 0.2, 0.34, 0.49, 0.59, 0.7, 5.0])
    schedule = LocalSchedule("auto", overhead=0.02, clock=lambda: next(clock))
    schedule.observe(skip=False, writing=False)  # 0.0
    schedule.observe(skip=False, writing=False)  # 0.1: start-up, left out
    schedule.observe(skip=False, writing=False)  # 0.2: a 0.1 s step
    schedule.took_copy(3, blocked_s=0.02)  # a copy after this step: 0.02 s of snapshot
    schedule.observe(skip=False, writing=True)  # 0.34: 0.14 s, of which 0.02 blocked: 0.02 over
    schedule.observe(skip=False, writing=True)  # 0.49: 0.15 s, 0.05 over
    schedule.observe(skip=True, writing=False)  # 0.59: a step that took a durable checkpoint
    schedule.observe(skip=False, writing=False)  # 0.7: its gap is left out
    schedule.observe(skip=False, writing=False)  # 5.0: a slow step, but no copy: not a cost
    assert abs(schedule.excess_s - 0.07) < 1e-9
    schedule.took_copy(9, blocked_s=0.03)
    assert abs(schedule.cost_s - 0.10) < 1e-9 and schedule.excess_s == 0


def test_payload_bytes_counts_tensors_only():
    tree = {"a": torch.zeros(10), "b": [torch.zeros(2, dtype=torch.int64), "x", 3]}
    assert payload_bytes(tree) == 40 + 16

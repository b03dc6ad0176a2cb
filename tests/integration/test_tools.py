"""The tools a user runs beside training: the benches and fault injection, end to end."""

from __future__ import annotations

import json
import os
import re

import pytest

from elastictrain.checkpoint.api import Tier
from tests.helpers.launcher import REPO_ROOT, final_state, run_single


# Tiny runs of each bench mode, one test each (so they run side by side): only sanity is asserted,
# that the figures are positive, add up, and the ratios are within bounds no working runner misses
# (the real targets are measured by hand, docs/performance.md).
@pytest.mark.slow
def test_bench_overhead_gives_sane_figures(tmp_path):
    def measure() -> dict:
        out = run_single(
            ["bench", "overhead", "--steps", "60", "--repeats", "1", "--json"], REPO_ROOT, 240
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout)

    def within(r: dict) -> bool:
        return all(-0.5 < r[k] < 1.0 for k in ("runner_overhead", "local_tier_overhead"))

    overhead = measure()
    if not within(overhead):
        # The three runs are sequential seconds on a shared 2-core machine: a burst of load from a
        # neighbouring test can halve one run's speed (seen once in CI: the plain loop at 50 ms a
        # step, ours at 22, then 14). A broken bench or runner is out of bounds twice.
        overhead = measure()
    assert overhead["plain_step_s"] > 0 and overhead["elastictrain_step_s"] > 0
    assert 0 < overhead["heartbeat_cpu_s"] < 0.01  # one beat: well under 10 ms of CPU
    ratio = overhead["elastictrain_step_s"] / overhead["plain_step_s"]
    assert overhead["runner_overhead"] == pytest.approx(ratio - 1)
    assert -0.5 < overhead["runner_overhead"] < 1.0, overhead  # same loop: never 2x slower
    local = overhead["with_local_tier_step_s"] / overhead["elastictrain_step_s"]
    assert overhead["local_tier_overhead"] == pytest.approx(local - 1)
    assert -0.5 < overhead["local_tier_overhead"] < 1.0, overhead


def test_bench_numerics_gives_sane_figures():
    """The checks' costs beside a step of the same model: each positive, each share its ratio."""
    out = run_single(
        ["bench", "numerics", "--size", "8MB", "--repeats", "1", "--json"], REPO_ROOT, 120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert 7 < got["params_mb"] < 9 and got["device"] == "cpu", got
    assert all(got[k] > 0 for k in ("step_s", "finite_check_s", "digest_s", "commit_check_s"))
    assert got["finite_check_share"] == pytest.approx(got["finite_check_s"] / got["step_s"])
    assert got["digest_share_at_100"] == pytest.approx(got["digest_s"] / 100 / got["step_s"])


def test_bench_loader_gives_sane_figures(tmp_path):
    out = run_single(
        ["bench", "loader", "--steps", "12", "--repeats", "1", "--json", "--load-ms", "30"],
        REPO_ROOT,
        240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    loader = json.loads(out.stdout)
    # Sleeps cannot overlap in one process: in-process loading costs at least load + compute.
    assert loader["in_process_vs_sum"] >= 0.95 and loader["workers_step_s"] > 0, loader
    assert loader["speedup"] == pytest.approx(
        loader["in_process_step_s"] / loader["workers_step_s"]
    )


@pytest.mark.slow
def test_bench_recovery_gives_sane_figures():
    """The restart's phases at 2 ranks. (``bench recovery --in-place``, 4 ranks as 2 simulated
    nodes of 2 in place and restarted, is a manual measurement: its 4-rank in-place job adds a
    dozen process starts, and test_in_place_sharded.py's HSDP test runs the same protocol, rank
    kills and a lost node at 4 ranks of 2 nodes, with stronger checks.)"""

    def measure() -> dict:
        out = run_single(["bench", "recovery", "--size", "1MB", "--json"], REPO_ROOT, 240)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout)

    recovery = measure()
    if not recovery["bare_torchrun"]["total_s"] < recovery["elastictrain"]["total_s"]:
        # The two restarts are sequential seconds on a shared 2-core machine: a burst of load
        # from a neighbouring test made the bare one the slower (6.9 s against 6.5, a fresh-clone
        # run on 2026-12-07), as test_bench_overhead's runs were. Out of order twice is a bug.
        recovery = measure()
    ours, bare = recovery["elastictrain"], recovery["bare_torchrun"]
    phases = ["detect_s", "restart_s", "startup_s", "init_s", "probe_s", "build_s", "load_s"]
    assert all(ours[p] >= 0 for p in [*phases, "first_step_s"]), ours
    # The phases are consecutive slices of kill -> first step: they cannot add up to more.
    assert sum(ours[p] for p in phases) <= ours["total_s"] * 1.05, ours
    assert 0 < bare["total_s"] < ours["total_s"] < 120 and ours["checkpoint_bytes"] > 100_000
    assert (
        recovery["ratio_to_bare_plus_read"] > 1.0
    )  # a restart with a load costs more than one without


@pytest.mark.slow
def test_bench_recovery_against_a_slow_remote_gives_sane_figures():
    """Three jobs side by side, durable tier at 50 MB/s: with the local tier the restart reads no
    state from the durable tier and redoes fewer steps than with the durable tier alone."""
    out = run_single(
        [
            "bench",
            "tiers",
            "--remote-mbps",
            "50",
            "--size",
            "8MB",
            "--repeats",
            "1",
            "--json",
            "--every",
            "30",
            # Copies at fixed steps: auto prices a copy by how it slows the steps around it, so
            # under the suite's load its interval can pass the kill. A CI run (2026-12-05) resumed
            # the two-tier job from the durable tier; that is the likely cause, not reproduced.
            "--local-every",
            "10",
        ],  # fmt: skip
        REPO_ROOT,
        300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    durable, local, empty = r["durable"], r["two_tiers"], r["empty"]
    assert (durable["tier"], local["tier"], empty["tier"]) == (Tier.DURABLE, Tier.LOCAL, "none"), r
    assert durable["remote_state_bytes_read"] >= durable["checkpoint_bytes"] > 100_000, r
    assert local["remote_state_bytes_read"] == 0 and empty["resumed_step"] == 0, r
    assert durable["resumed_step"] >= 30 and durable["resumed_step"] % 30 == 0, r
    assert local["resumed_step"] >= durable["resumed_step"], r
    assert 0 <= local["steps_redone"] <= durable["steps_redone"], r
    assert all(m["kill_to_first_step_s"] > 0 for m in (durable, local, empty)), r


@pytest.mark.slow
def test_bench_sharded_gives_sane_figures(tmp_path):
    out = run_single(
        ["bench", "sharded", "--size", "24MB", "--repeats", "3", "--json",
         "--checkpoint-dir", str(tmp_path)],
        REPO_ROOT,
        240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert len(r["ranks"]) == 2 and len(r["resume_at_3"]) == 3
    # Every rank holds half of the state; at 3 ranks each read at least its own new shard.
    assert all(abs(x["shard_bytes"] - r["state_bytes"] / 2) < 1e6 for x in r["ranks"]), r
    assert all(x["read_bytes"] >= x["new_shard_bytes"] > 0 for x in r["resume_at_3"]), r
    assert 0 < r["blocked_over_copy"] < 20 and r["save_throughput_over_dcp"] > 0, r
    assert 0 < r["peak_extra_over_shard"] < 3, r
    assert r["read_over_new_shard"] < 1.5, r  # 64 KiB blocks: little is read that is not needed
    assert not os.listdir(tmp_path)  # the scratch folder is removed


@pytest.mark.slow
def test_chaos_kills_a_worker_and_the_job_still_finishes(tmp_path):
    ckpt = str(tmp_path / "c")
    job = [
        *("torchrun", "--standalone", "--nproc_per_node=2", "--max-restarts=2"),
        *("-m", "elastictrain", "--checkpoint-dir", ckpt, "--max-steps", "200"),
        *("--checkpoint-every-steps", "50", "--task-option", "step_time=0.01"),
    ]
    log = str(tmp_path / "job.log")
    args = ["chaos", "--fault", "kill-worker", "--first", "3", "--seed", "7", "--log", log]
    out = run_single([*args, "--timeout", "150", "--", *job], str(tmp_path), 200)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    (killed,) = re.findall(r"fault 1: kill-worker -> pid (\d+)", out.stdout)
    assert "job exited with 0; 1 fault(s) injected" in out.stdout
    with open(log) as f:
        text = f.read()
    # torchrun saw exactly that process die of SIGKILL, and restarted the group.
    assert "failed (exitcode: -9) local_rank: " in text and f"(pid: {killed})" in text, text[-3000:]
    assert final_state(ckpt)["progress"]["step"] == 200


def test_chaos_without_a_command_says_how(tmp_path):
    out = run_single(["chaos", "--fault", "kill-node"], str(tmp_path), 60)
    assert out.returncode == 2 and "name the job after --" in out.stderr

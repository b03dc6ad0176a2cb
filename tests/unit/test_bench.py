"""``python -m elastictrain bench`` runs end to end (tiny size: a smoke test, not a measurement)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from elastictrain.bench.commands import _upgrade, build_parser
from elastictrain.bench.state import synthetic_state
from elastictrain.tools.sizes import parse_size
from tests.helpers.launcher import REPO_ROOT, job_env

KEYS = {
    "copy_s",
    "raw_write_gbps",
    "raw_read_gbps",
    "torch_save_s",
    "dcp_save_s",
    "dcp_async_blocked_s",
    "elastictrain_blocked_s",
    "elastictrain_persist_s",
    "persist_gbps",
    "persist_over_raw_write",
    "blocked_over_copy",
    "load_over_raw_read",
    "pairs",
    "noisy",
    "load_s",
    "load_gbps",
    "step_inflation",
}


def test_sizes():
    assert parse_size("2GB") == 2_000_000_000 and parse_size("1.5 MiB") == 1.5 * 2**20
    with pytest.raises(Exception, match="512MB"):
        parse_size("lots")
    state = synthetic_state(30_000_000, tensor_bytes=4 << 20)
    total = sum(t.numel() * 4 for d in (state["model"],) for t in d.values())
    assert abs(total * 3 - 30_000_000) < 64  # weights are a third; the moments the rest


def test_bench_reports_every_figure_as_json(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastictrain",
            "bench",
            "persist",
            "--checkpoint-dir",
            str(tmp_path),
            "--size",
            "8MB",
            "--repeats",
            "1",
            "--json",
        ],
        cwd=REPO_ROOT,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert set(result) >= KEYS
    dcp = {"dcp_save_s", "dcp_async_blocked_s"}
    assert all(result[k] > 0 for k in KEYS - {"step_inflation", "pairs", "noisy"} - dcp)
    # Every ratio is the median of back-to-back pairs with its floor, with their spread.
    for name in ("blocked", "persist", "load", "load_warm"):
        pair = result["pairs"][name]
        assert len(pair["ratios"]) == 1 and pair["spread"] == 0 and pair["ratio"] > 0, pair
    assert result["persist_over_raw_write"] == result["pairs"]["persist"]["ratio"]
    try:
        import numpy  # noqa: F401
    except ImportError:  # DCP's writer needs numpy, which torch does not depend on
        assert all(result[k] is None for k in dcp)
    else:
        assert all(result[k] > 0 for k in dcp)
    assert list(tmp_path.iterdir()) == []  # its scratch folder is gone


def test_each_bench_is_a_subcommand_with_its_own_defaults_and_old_flags_still_work(capsys):
    parse = build_parser().parse_args
    assert parse(["recovery"]).size == parse_size("64MB")
    assert parse(["tiers"]).size == parse_size("256MB") and parse(["tiers"]).remote_mbps == 50
    assert parse(["tiers"]).local_every == "auto"
    assert parse(["tiers", "--local-every", "10"]).local_every == "10"
    assert parse(["persist", "--size=2GB"]).size == parse_size("2GB")  # = form: no argv sniffing
    assert parse(["overhead"]).steps == 2000 and parse(["loader"]).steps == 60
    with pytest.raises(SystemExit):
        parse(["overhead", "--size", "1GB"])  # a bench's options are its own
    assert _upgrade(["--recovery", "--remote-mbps", "50"]) == ["tiers", "--remote-mbps", "50"]
    assert _upgrade(["--sharded", "--size", "1GB"]) == ["sharded", "--size", "1GB"]
    assert _upgrade(["--size", "1GB"]) == ["persist", "--size", "1GB"]
    assert "deprecated: use 'bench persist --size 1GB'" in capsys.readouterr().err
    assert _upgrade(["loader", "--steps", "5"]) == ["loader", "--steps", "5"]


def test_every_bench_child_gets_this_checkout_on_its_path_and_one_thread():
    import os

    from elastictrain.bench.child import REPO_ROOT as BENCH_ROOT
    from elastictrain.bench.child import child_env, torchrun

    env = child_env()
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO_ROOT) == BENCH_ROOT
    assert env["OMP_NUM_THREADS"] == "1"
    assert torchrun("-m", "x", nproc=3)[-3:] == ["--nproc_per_node=3", "-m", "x"]

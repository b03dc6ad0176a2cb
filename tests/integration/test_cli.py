"""``python -m elastictrain ls|verify|inspect|prune`` on local and S3 URLs."""

from __future__ import annotations

import glob
import json
import os
import subprocess

import pytest

import storage
from tests.helpers.launcher import run_single
from tests.helpers.net import free_port


def cli(*args: str, cwd: str) -> subprocess.CompletedProcess:
    return run_single(list(args), cwd)


@pytest.fixture(params=["local", "s3"])
def checkpoints(request, tmp_path):
    """A run with checkpoints at steps 10..50; returns (url, --storage-option args)."""
    if request.param == "local":
        url, opts = str(tmp_path / "c"), []
    else:
        bucket, options = request.getfixturevalue("s3_bucket")
        url, opts = (
            f"{bucket}/run",
            [a for k, v in options.items() for a in ("--storage-option", f"{k}={v}")],
        )
    result = run_single(
        [
            "--checkpoint-dir",
            url,
            *opts,
            "--max-steps",
            "50",
            "--checkpoint-every-steps",
            "10",
            "--keep-last",
            "10",
        ],
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return url, opts


def test_verify_inspect_prune(checkpoints, tmp_path):
    url, opts = checkpoints
    ok = cli("verify", url, "--json", *opts, cwd=str(tmp_path))
    assert ok.returncode == 0 and all(r["ok"] for r in json.loads(ok.stdout)["results"])

    doc = json.loads(cli("inspect", url, "--step", "30", "--json", *opts, cwd=str(tmp_path)).stdout)
    names = {t["name"]: t for t in doc["tensors"]}
    assert doc["step"] == 30 and doc["metadata"]["world_size"] == 1
    assert (
        names["model.net1.weight"]["shape"] == [10, 10]
        and names["model.net1.weight"]["bytes"] == 400
    )

    dry = json.loads(
        cli(
            "prune",
            url,
            "--keep-last",
            "1",
            "--keep-every-steps",
            "20",
            "--dry-run",
            "--json",
            *opts,
            cwd=str(tmp_path),
        ).stdout
    )
    assert dry["deleted"] == [10, 30] and dry["dry_run"]
    assert [
        c["step"]
        for c in json.loads(cli("ls", url, "--json", *opts, cwd=str(tmp_path)).stdout)[
            "checkpoints"
        ]
    ] == [10, 20, 30, 40, 50]
    done = json.loads(
        cli(
            "prune",
            url,
            "--keep-last",
            "1",
            "--keep-every-steps",
            "20",
            "--json",
            *opts,
            cwd=str(tmp_path),
        ).stdout
    )
    assert done["deleted"] == [10, 30] and done["newest_good"] == 50


def test_verify_fails_on_a_corrupt_checkpoint(tmp_path):
    url = str(tmp_path / "c")
    assert (
        run_single(
            ["--checkpoint-dir", url, "--max-steps", "20", "--checkpoint-every-steps", "10"],
            str(tmp_path),
        ).returncode
        == 0
    )
    (path,) = glob.glob(os.path.join(url, "step-000000000020", "state-g*"))
    with open(path, "r+b") as f:
        f.truncate(100)
    bad = cli("verify", url, cwd=str(tmp_path))
    assert bad.returncode == 1 and "step 20: BAD" in bad.stdout and "step 10: OK" in bad.stdout
    # prune never deletes the newest checkpoint that verifies (step 10 here).
    out = cli("prune", url, "--keep-last", "1", "--json", cwd=str(tmp_path))
    assert json.loads(out.stdout)["newest_good"] == 10
    assert 10 in storage.open_store(url).committed_steps()


TOOLS = [
    ["ls"],
    ["verify"],
    ["inspect"],
    ["prune", "--keep-last", "1"],
    ["bench", "persist", "--size", "1MB"],
]


def _tool_on(command: list[str], url: str, options: list[str], cwd: str):
    if command[0] == "bench":  # bench SUBCOMMAND --checkpoint-dir URL ...
        return cli(*command[:2], "--checkpoint-dir", url, *command[2:], *options, cwd=cwd)
    return cli(command[0], url, *command[1:], *options, cwd=cwd)


@pytest.mark.parametrize("command", TOOLS, ids=[c[0] for c in TOOLS])
def test_every_storage_command_names_a_missing_bucket(command, tmp_path, s3_endpoint):
    """The runner's preflight, for every tool: one line naming the cause, no traceback."""
    url, options = "s3://no-such-bucket-et/run", ["--storage-option", f"endpoint_url={s3_endpoint}"]
    result = _tool_on(command, url, options, str(tmp_path))
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{url!r} is not usable" in result.stderr and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_read_only_commands_name_a_dead_endpoint_within_the_probe_deadline(tmp_path):
    """The read-only probe keeps the write probe's 10 s promise (that one is tested through the
    runner, test_resume_edge_cases.py), then says it in one line."""
    dead = ["--storage-option", f"endpoint_url=http://127.0.0.1:{free_port()}"]
    result = _tool_on(["ls"], "s3://some-bucket/run", dead, str(tmp_path))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "could not be reached" in result.stderr and "Traceback" not in result.stderr

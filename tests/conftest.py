"""Shared fixtures: a real S3 endpoint on loopback (moto_server), free ports, storage URLs."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto_server S3 endpoint on a free loopback port; killed by its own process group."""
    if shutil.which("moto_server") is None:
        pytest.fail("moto_server not found: install the test extras (pip install -e '.[test]')")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    port = free_port()
    proc = subprocess.Popen(
        [shutil.which("moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url, timeout=1)
            break
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail(f"moto_server did not start on {url}")
            time.sleep(0.2)
    try:
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh bucket; returns (bucket URL, storage options)."""
    import s3fs

    options = {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing"}
    bucket = f"et-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**options).mkdir(bucket)
    return f"s3://{bucket}", options


@pytest.fixture(params=["local", "memory", "s3"])
def store_location(request, tmp_path):
    """(url, storage_options) for each backend the storage contract must hold on."""
    if request.param == "local":
        return str(tmp_path / "ckpt"), {}
    if request.param == "memory":
        return f"memory://et-{uuid.uuid4().hex}/ckpt", {}
    bucket_url, options = request.getfixturevalue("s3_bucket")
    return f"{bucket_url}/run", options


def python() -> str:
    return sys.executable


@pytest.fixture
def launch(tmp_path):
    """Start torchrun jobs that are always killed (agent + descendants) at teardown."""
    from tests.integration.launcher import Job

    jobs: list[Job] = []

    def start(
        app_args: list[str],
        *,
        nproc: int = 2,
        max_restarts: int = 3,
        torchrun_args=None,
        env=None,
        name: str = "job",
    ) -> Job:
        targs = torchrun_args or [
            "--standalone",
            f"--nproc_per_node={nproc}",
            f"--max-restarts={max_restarts}",
        ]
        job = Job(
            targs, app_args, str(tmp_path / f"{name}-{len(jobs)}.log"), cwd=str(tmp_path), env=env
        )
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        if job.proc.poll() is None:
            job.kill()

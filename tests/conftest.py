"""Shared fixtures: a real S3 endpoint on loopback (moto_server), free ports, storage URLs, a
one-process gloo world."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import uuid

import pytest

from tests.helpers.one_process import gloo_world  # noqa: F401  (a fixture, used by name)
from tests.helpers.s3 import moto_server

HEAVIEST = [
    "test_tensor_parallel",
    # Its HSDP test is the suite's longest (about 2 minutes), but with 14 processes it must not
    # start beside its FSDP sibling and the 2-D layouts at once (its first checkpoint took over
    # 120 s so, with five workers).
    "test_in_place_sharded",
    "test_tied_weights",
    "test_streams",
    "test_in_place",
    "test_multinode",
    "test_sharded",
    "test_examples",
    "test_elastic",
]


def pytest_collection_modifyitems(config, items):
    """Longest tests first. The suite runs on four xdist workers (pyproject addopts); started last,
    a 100 s test would run alone at the end while the other workers idle."""

    def weight(item) -> tuple[int, int]:
        if item.get_closest_marker("slow"):
            # The heaviest files first (1 to 2 minutes a test on a loaded 2-core machine): in file
            # order they came last, and ran on after the rest of the suite had finished.
            name = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
            return 0, HEAVIEST.index(name) if name in HEAVIEST else len(HEAVIEST)
        return (1 if "/integration/" in item.nodeid.replace("\\", "/") else 2), 0

    items.sort(key=weight)  # stable: file order is kept within each group
    if not _cuda_available():
        skip = pytest.mark.skip(reason="needs CUDA: the GPU tier runs with bash tests/gpu/run.sh")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="session", autouse=True)
def _children_tmpdir(tmp_path_factory):
    """torchrun leaves a ``torchelastic_*`` log directory in TMPDIR for every run and never removes
    it. Point the processes the tests start at pytest's own temp tree, which pytest prunes, so a
    suite run leaves nothing behind in /tmp."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(tmp_path_factory.mktemp("children-tmp")))
        yield


@pytest.fixture(scope="session", autouse=True)
def _local_tier_root():
    """The local checkpoint tier is on by default, in /dev/shm, and a killed job's copies stay
    there for its restart. Give each test session (each xdist worker) its own folder under
    /dev/shm, removed at the end, so the suite leaves no memory behind."""
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="elastictrain-tests-", dir="/dev/shm")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ELASTICTRAIN_LOCAL_ROOT", root)
        yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto_server S3 endpoint that accepts any credentials."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with moto_server() as url:
        yield url


@dataclasses.dataclass(frozen=True)
class AuthS3:
    """An S3 endpoint that checks credentials, with a bucket, a read-write and a read-only user."""

    endpoint: str
    bucket: str
    read_write: dict[str, str]
    read_only: dict[str, str]


@pytest.fixture(scope="session")
def s3_auth():
    """moto with IAM auth on: unknown keys are rejected, and a read-only user exists."""
    import boto3

    # The first 3 requests (create the admin user, its key, its policy) run unauthenticated.
    with moto_server({"INITIAL_NO_AUTH_ACTION_COUNT": "3"}) as url:
        kw = {"endpoint_url": url, "region_name": "us-east-1"}
        iam = boto3.client("iam", aws_access_key_id="x", aws_secret_access_key="x", **kw)

        def user(name: str, actions: list[str] | str) -> dict[str, str]:
            iam.create_user(UserName=name)
            key = iam.create_access_key(UserName=name)["AccessKey"]
            policy = {"Effect": "Allow", "Action": actions, "Resource": "*"}
            iam.put_user_policy(
                UserName=name,
                PolicyName=name,
                PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [policy]}),
            )
            return {"key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}

        admin = user("admin", "*")
        iam = boto3.client(
            "iam", aws_access_key_id=admin["key"], aws_secret_access_key=admin["secret"], **kw
        )
        read_only = user("reader", ["s3:GetObject", "s3:ListBucket"])
        s3 = boto3.client(
            "s3", aws_access_key_id=admin["key"], aws_secret_access_key=admin["secret"], **kw
        )
        s3.create_bucket(Bucket="guarded")
        yield AuthS3(endpoint=url, bucket="guarded", read_write=admin, read_only=read_only)


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
    from tests.helpers.launcher import Job

    jobs: list[Job] = []

    def start(
        app_args: list[str],
        *,
        nproc: int = 2,
        max_restarts: int = 3,
        torchrun_args=None,
        env=None,
        name: str = "job",
        entry: tuple[str, ...] = ("-m", "elastictrain"),
        script: list[str] | None = None,
        cwd: str | None = None,
        plain: bool = False,
    ) -> Job:
        """``script``: a launch script run (with ``app_args`` after it) instead of torchrun.
        ``cwd``: where it starts (default the test's tmp_path): one folder per simulated node.
        ``plain``: ``nproc`` ranks without torchrun's agent (tests/helpers/plain_ranks.py), for
        a run that is compared against and never killed: about 2 s less CPU a launch."""
        log = str(tmp_path / f"{name}-{len(jobs)}.log")
        cwd = cwd or str(tmp_path)
        if plain:
            script = [sys.executable, "-m", "tests.helpers.plain_ranks", str(nproc), *entry]
        if script is not None:
            jobs.append(Job.wrapping([*script, *app_args], log, cwd=cwd, env=env))
            return jobs[-1]
        targs = torchrun_args or [
            "--standalone",
            f"--nproc_per_node={nproc}",
            f"--max-restarts={max_restarts}",
        ]
        job = Job(
            targs,
            app_args,
            log,
            cwd=cwd,
            env=env,
            entry=entry,
        )
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        if job.proc.poll() is None:
            job.kill()


@pytest.fixture
def committed_files():
    """``committed_files(*folders)``: a write-once checker over the folders, watching from now
    (tests/helpers/committed_files.py); the test calls ``.check()``, teardown stops it anyway."""
    from tests.helpers.committed_files import CommittedFiles

    started: list[CommittedFiles] = []

    def watch(*folders) -> CommittedFiles:
        started.append(CommittedFiles(*folders).start())
        return started[-1]

    yield watch
    for files in started:
        files.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ELASTICTRAIN_CPU_REPORT=FILE, append each test's wall and CPU seconds (its own and its
    waited-for children's: torchrun and every worker) to FILE. The suite is CPU-bound on 2 cores,
    so CPU, not wall time, says which test to make cheaper (CONTRIBUTING.md)."""
    path = os.environ.get("ELASTICTRAIN_CPU_REPORT")
    if not path:
        yield
        return
    import resource
    import time

    def cpu() -> float:
        own, kids = (
            resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        )
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    wall, used = time.monotonic(), cpu()
    yield
    with open(path, "a") as f:
        f.write(f"{cpu() - used:.1f}\t{time.monotonic() - wall:.1f}\t{item.nodeid}\n")

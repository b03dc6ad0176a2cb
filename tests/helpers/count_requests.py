"""Count the S3 requests a job makes, by kind, through moto and the (fault-free) fault proxy: the
measured base of docs/scale.md's request arithmetic.

    python -m tests.helpers.count_requests            # DDP and FSDP, 2 ranks, 5 checkpoints each

Each job runs 100 steps with a checkpoint every 20 (the 5th is the final one) under
``torchrun --standalone --nproc_per_node=2``; requests are grouped by what they touch.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import uuid

import boto3

from tests.helpers.fault_proxy import FaultProxy
from tests.helpers.launcher import job_env
from tests.helpers.s3 import moto_server

_STEP = re.compile(r"/step-\d{12}/([^/?]+)")


def classify(method: str, path: str) -> str:
    """A request's kind: the method and which file or listing it touches."""
    query = path.partition("?")[2]
    if "list-type" in query or (method == "GET" and path.rstrip("/").count("/") <= 1):
        return f"{method} list"
    if "uploads" in query or "uploadId" in query:
        return f"{method} multipart"
    m = _STEP.search(path)
    if m:
        name = re.sub(r"r\d{5}", "rN", re.sub(r"-g\d+", "", m.group(1)))
        return f"{method} step/{name}"
    for part in ("events/", "fence.json", "node-check", ".probe-"):
        if part in path:
            return f"{method} {part.rstrip('/')}"
    return f"{method} other"


def run_job(endpoint: str, bucket: str, extra: list[str], workdir: str) -> None:
    args = ["--checkpoint-dir", f"s3://{bucket}/run", "--storage-option"]
    args += [f"endpoint_url={endpoint}", "--max-steps", "100", "--checkpoint-every-steps", "20"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = subprocess.run(
        [*cmd, "-m", "elastictrain", *args, *extra],
        cwd=workdir,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    for key, value in (("AWS_ACCESS_KEY_ID", "t"), ("AWS_SECRET_ACCESS_KEY", "t")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    jobs = {
        "ddp": [],
        "fsdp": ["--parallel", "fsdp", "--task-option", "hidden=64", "--task-option", "layers=2"],
    }
    with moto_server() as upstream, tempfile.TemporaryDirectory() as workdir:
        s3 = boto3.client("s3", endpoint_url=upstream)
        for name, extra in jobs.items():
            bucket = f"count-{uuid.uuid4().hex[:8]}"
            s3.create_bucket(Bucket=bucket)
            with FaultProxy(upstream) as proxy:
                run_job(proxy.url, bucket, extra, workdir)
                kinds = collections.Counter(classify(m, p) for m, p in proxy.requests)
            print(f"{name}: {len(proxy.requests)} requests for 5 checkpoints (2 ranks)")
            for kind, n in sorted(kinds.items()):
                print(f"  {n:5d}  {kind}")


if __name__ == "__main__":
    main()

"""``python -m tests.helpers.plain_ranks NPROC PROGRAM...``: NPROC ranks of PROGRAM on this host,
each given what torchrun gives a worker (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), with no agent in between.

For the runs a test compares against (an uninterrupted reference, a run that is never killed):
torchrun's agent imports torch and tears it down, about 2 s of CPU a launch on this 2-core
machine, and the suite is CPU-bound (CONTRIBUTING.md). Anything about torchrun itself (restarts,
rendezvous, the agent's death, in-place recovery) keeps a real torchrun launch.

This process imports no torch. The first rank to fail ends the others (SIGTERM, then SIGKILL),
and its exit code is this process's; 0 when every rank exits 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.helpers.net import free_port

STOP_GRACE_S = 10.0


def main(argv: list[str]) -> int:
    nproc, program = int(argv[0]), argv[1:]
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    base.update(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    ranks = [
        subprocess.Popen(
            [sys.executable, *program], env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}
        )
        for r in range(nproc)
    ]
    # A stop signal to this process (the test's teardown kills the whole group anyway) ends them.
    signal.signal(signal.SIGTERM, lambda *_: _end(ranks, signal.SIGTERM))
    while True:
        codes = [p.poll() for p in ranks]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            _end(ranks, signal.SIGTERM)
            return failed[0] if failed[0] > 0 else 128 - failed[0]
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.1)


def _end(ranks: list[subprocess.Popen], sig: int) -> None:
    for p in ranks:
        if p.poll() is None:
            p.send_signal(sig)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in ranks:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

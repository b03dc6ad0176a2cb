"""``python -m tests.helpers.two_real_hosts power|cut [RUNNER FLAGS...]`` (root): a manual
measurement on real hosts (``real_hosts.RealHosts``): 2 nodes of 2 ranks, c10d on node 0's
address, the toy at step_time 0.01 with the suite's rendezvous timings; once step 300 is
committed node 1 is powered off (``power``) or cut off (``cut``), and it prints when node 0
trained again (its next ``start``/``resume`` events) and how each node ended. E.g. with
``--replace-in-place``. Files under /tmp/two-real-hosts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from tests.helpers.elastic import TEST_RDZV_CONF
from tests.helpers.launcher import job_env
from tests.helpers.real_hosts import RealHosts

SHARED = "/tmp/two-real-hosts"


def _events() -> list[dict]:
    try:
        with open(f"{SHARED}/ev0.jsonl") as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def main(argv: list[str]) -> int:
    mode, flags = (argv[0] if argv else "power"), argv[1:]
    shutil.rmtree(SHARED, ignore_errors=True)
    os.makedirs(SHARED)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with RealHosts(2) as hosts:
        procs = []
        for i in range(2):
            args = [
                *(sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2"),
                *("--nproc_per_node=2", "--rdzv-backend=c10d", "--rdzv-id=two-real-hosts"),
                f"--rdzv-endpoint={hosts.addr(0)}:29400",
                f"--local-addr={hosts.addr(i)}",
                *("--max-restarts=3", "--monitor-interval=0.5"),
                f"--rdzv-conf={TEST_RDZV_CONF},is_host={int(i == 0)}",
                *("-m", "elastictrain", "--checkpoint-dir", f"{SHARED}/ckpt"),
                *("--event-log", f"{SHARED}/ev{i}.jsonl", "--max-steps", "3000"),
                *("--checkpoint-every-steps", "100", "--task-option", "step_time=0.01"),
                *("--progress", "plain", *flags),
            ]
            env = {**job_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
            with open(f"{SHARED}/node{i}.log", "w") as log:
                procs.append(
                    hosts.popen(i, args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=repo)
                )
        t0 = time.time()
        while time.time() - t0 < 180 and not any(
            e.get("event") == "checkpoint" and e.get("step", 0) >= 300 for e in _events()
        ):
            if any(p.poll() is not None for p in procs):
                print("a node ended early:", [p.poll() for p in procs])
                return 1
            time.sleep(0.2)
        fault = time.time()
        hosts.power_off(1) if mode == "power" else hosts.cut(1)
        print(f"{mode} node 1 at +{fault - t0:.1f} s")
        code = procs[0].wait(300)
        print(f"node 0 exited {code} after {time.time() - fault:.1f} s; node 1: {procs[1].poll()}")
        after = [e for e in _events() if e.get("time", 0) > fault]
        for e in [e for e in after if e["event"] in ("start", "resume")][:4]:
            print(f"+{e['time'] - fault:.1f} s {e['event']} world {e.get('world_size')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

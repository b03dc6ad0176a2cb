"""Does a clean finish exit 0, every time? The tutorial's loop in library mode, and the runner.

    python -m tests.helpers.clean_exit --runs 50 [--runner | --in-place] [--workers 2]

Each run is a fresh ``torchrun --standalone --nproc_per_node=2 --max-restarts=0`` job in its own
folder: library mode runs this file's ``loop`` (plain ``dist.init_process_group("gloo")``, DDP,
``CheckpointManager``, ``close()``, ``destroy_process_group()``, then a normal return: no
``os._exit``); ``--in-place`` runs ``examples/custom_loop.py --replace-in-place`` (library mode
through ``init_distributed``: its heartbeat and its epoch's watch, a supervisor and a spare per
rank); ``--runner`` runs ``-m elastictrain`` (the toy task). Prints one line per failed run (exit
code and the first telling line of its log), and a JSON summary line that also counts the
processes whose exit left a thread of elastictrain's running (``threads_at_exit``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from tests.helpers import threads_at_exit
from tests.helpers.paths import REPO_ROOT


def loop(url: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from elastictrain import CheckpointManager

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    # 16 MB of weights + momentum: past the size from which payloads are hashed on a helper
    # thread while they are written, so every thread the manager can start is started.
    width = 10 if os.environ.get("CLEAN_EXIT_SMALL") else 1024
    model = nn.Sequential(
        nn.Linear(10, width), nn.ReLU(), nn.Linear(width, width), nn.Linear(width, 5)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ckpt = CheckpointManager(
        url,
        checkpoint_every_steps=5,
        event_log=os.path.join(url, "..", "events.jsonl"),
        hang_timeout=120,
    )
    start = ckpt.resume(model, optimizer)
    net = DDP(model)
    for step in range(start, 20):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 10, generator=g), torch.randn(8, 5, generator=g)
        optimizer.zero_grad()
        nn.functional.mse_loss(net(x[rank::world]), y[rank::world]).backward()
        optimizer.step()
        ckpt.step(step + 1, model, optimizer)
    ckpt.save(20, model, optimizer, final=True)
    ckpt.close()
    dist.destroy_process_group()


def _entry(mode: str, here: str) -> list[str]:
    ckpt = os.path.join(here, "ckpt")
    if mode == "runner":
        return ["-m", "elastictrain", "--max-steps", "30", "--checkpoint-dir", ckpt]
    if mode == "in-place":
        loop = ["--steps", "40", "--every-steps", "10", "--replace-in-place"]
        return [
            os.path.join(REPO_ROOT, "examples", "custom_loop.py"),
            "--checkpoint-dir",
            ckpt,
            *loop,
        ]
    return [__file__, "loop", ckpt]


def _one(i: int, mode: str, root: str) -> tuple[int, int, str, int]:
    here = os.path.join(root, f"run-{i}")
    os.makedirs(here)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=0",
        *_entry(mode, here),
    ]
    env = threads_at_exit.env({**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"})
    out = subprocess.run(cmd, cwd=here, env=env, capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    telling = next(
        (
            line
            for line in log.splitlines()
            if any(w in line for w in ("terminate called", "Signal", "exitcode", "Error"))
        ),
        log.strip().splitlines()[-1] if log.strip() else "",
    )
    if out.returncode != 0 and os.environ.get("CLEAN_EXIT_KEEP"):  # a folder for failed runs' logs
        os.makedirs(os.environ["CLEAN_EXIT_KEEP"], exist_ok=True)
        with open(os.path.join(os.environ["CLEAN_EXIT_KEEP"], f"run-{i}.log"), "w") as f:
            f.write(log)
    return i, out.returncode, telling[:300], len(threads_at_exit.ours_left(log)[1])


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "loop":
        loop(sys.argv[2])
        return 0
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=50)
    modes = p.add_mutually_exclusive_group()
    modes.add_argument("--runner", action="store_true")
    modes.add_argument("--in-place", action="store_true", help="init_distributed, in place")
    p.add_argument("--workers", type=int, default=1, help="runs at once")
    args = p.parse_args()
    mode = "runner" if args.runner else "in-place" if args.in_place else "library"
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as root, ThreadPoolExecutor(args.workers) as pool:
        results = list(pool.map(lambda i: _one(i, mode, root), range(args.runs)))
    failed = [(i, rc, why) for i, rc, why, _ in results if rc != 0]
    for i, rc, why in failed:
        print(f"run {i}: exit {rc}: {why}")
    summary = {
        "mode": mode,
        "runs": args.runs,
        "nonzero": len(failed),
        "exits_leaving_threads": sum(left for *_, left in results),
        "seconds": round(time.monotonic() - t0, 1),
    }
    print("CLEAN_EXIT " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

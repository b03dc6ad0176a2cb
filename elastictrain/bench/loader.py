"""``python -m elastictrain bench loader``: does loading overlap compute with ``--num-workers``?

A task whose ``dataset[i]`` sleeps (simulated I/O or decoding: ``--load-ms`` per micro-batch) and
whose ``loss_fn`` sleeps (simulated compute: ``--compute-ms`` per step) is trained by the real
runner in one process, with 0 and with N loader workers, alternating, ``--repeats`` times each.
Sleeping needs no CPU, so the figure is honest on a 2-core machine: in-process loading costs
load + compute per step, and workers should bring it down to max(load, compute).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping

import torch
from torch import nn
from torch.utils.data import Dataset

from elastictrain.bench.child import child_env
from elastictrain.observe.events import Event, read_events
from elastictrain.task import Task, option

BATCH = 16


class SlowDataset(Dataset):
    """Samples that take ``load_s / BATCH`` each to "read", so a batch takes ``load_s``."""

    def __init__(self, load_s: float, size: int = 4096) -> None:
        self.per_sample_s = load_s / BATCH
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(size, 10, generator=g), torch.randn(size, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        time.sleep(self.per_sample_s)
        return self.x[i], self.y[i]


def make_task(options: Mapping[str, str]) -> Task:
    compute_s = option(options, "compute_s", 0.05, float)

    def loss_fn(model: nn.Module, batch):
        time.sleep(compute_s)
        return nn.functional.mse_loss(model(batch[0]), batch[1])

    return Task(
        model=nn.Linear(10, 1),
        dataset=SlowDataset(option(options, "load_s", 0.05, float)),
        batch_size=BATCH,
        make_optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
        loss_fn=loss_fn,
    )


def step_s(workers: int, load_s: float, compute_s: float, steps: int, workdir: str) -> float:
    """Mean step time of the real runner (steps after the first, from its ``end`` event)."""
    ev = os.path.join(workdir, f"ev-{workers}-{time.monotonic_ns()}.jsonl")
    env = child_env()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "elastictrain",
            "--task",
            "elastictrain.bench.loader:make_task",
            "--task-option",
            f"load_s={load_s}",
            "--task-option",
            f"compute_s={compute_s}",
            "--num-workers",
            str(workers),
            "--max-steps",
            str(steps),
            "--event-log",
            ev,
            "--checkpoint-dir",
            os.path.join(workdir, f"c-{workers}-{time.monotonic_ns()}"),
            "--checkpoint-every-steps",
            "0",
            "--log-every-seconds",
            "1000",
            "--progress",
            "plain",
        ],
        env=env,
        check=True,
        capture_output=True,
        timeout=600,
    )
    (end,) = [e for e in read_events(ev) if e["event"] == Event.END]
    return end["after_first_step_s"] / (steps - 1)


def run(workers: int, load_s: float, compute_s: float, steps: int, repeats: int) -> dict:
    in_process, parallel = [], []
    with tempfile.TemporaryDirectory() as workdir:
        for _ in range(repeats):
            in_process.append(step_s(0, load_s, compute_s, steps, workdir))
            parallel.append(step_s(workers, load_s, compute_s, steps, workdir))
    ours, theirs = statistics.median(parallel), statistics.median(in_process)
    return {
        "load_s": load_s,
        "compute_s": compute_s,
        "workers": workers,
        "steps": steps,
        "in_process_step_s": theirs,
        "workers_step_s": ours,
        "in_process_vs_sum": theirs / (load_s + compute_s),
        "workers_vs_max": ours / max(load_s, compute_s),
        "speedup": theirs / ours,
    }


def main(
    workers: int, load_s: float, compute_s: float, steps: int, repeats: int, as_json: bool
) -> int:
    r = run(workers, load_s, compute_s, steps, repeats)
    if as_json:
        print(json.dumps(r, indent=1))
    else:
        print(
            f"load {load_s * 1e3:.0f} ms + compute {compute_s * 1e3:.0f} ms per step, {steps} "
            f"steps, median of {repeats}:\n"
            f"in-process loading  {r['in_process_step_s'] * 1e3:7.1f} ms/step "
            f"({r['in_process_vs_sum']:.2f}x load + compute)\n"
            f"{workers} loader workers    {r['workers_step_s'] * 1e3:7.1f} ms/step "
            f"({r['workers_vs_max']:.2f}x max(load, compute))\n"
            f"speedup             {r['speedup']:.2f}x"
        )
    return 0

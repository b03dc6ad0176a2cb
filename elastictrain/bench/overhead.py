"""``python -m elastictrain bench overhead``: the runner's per-step cost, with no checkpoint due.

Runs the same 2-worker toy task under ``torchrun --standalone`` three ways, in turn, ``--repeats``
times each: a plain DDP loop that calls the very same ``Trainer.step`` and nothing else (no
per-step flag all-reduce, watchdog, progress or checkpoint checks); the full runner without the
local tier (``-m elastictrain --checkpoint-every-steps 0 --no-local-checkpoint``); the same without
liveness's heartbeats (``--silent-timeout 0``, with ``--repeats`` above 1); and the runner with its local tier on ``auto`` (the
default). All time the steps after the first, the same way. ``runner_overhead`` is the median ratio
of the runner's mean step time to the plain loop's; ``liveness_overhead`` the median ratio of the
runner with heartbeats to without; ``local_tier_overhead`` the median ratio of the runner with the
local tier to without it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from elastictrain.bench.child import child_env, torchrun
from elastictrain.observe.events import Event

TASK_OPTIONS = {"hidden": "512", "layers": "4", "batch_size": "64", "step_time": "0"}


def plain_loop(steps: int, out: str) -> None:
    """The plain DDP loop, run by each torchrun worker."""
    from elastictrain.task import build_task
    from elastictrain.train.data import GlobalBatchSampler
    from elastictrain.train.loader import StepLoader
    from elastictrain.train.loop import Trainer
    from elastictrain.train.precision import Precision

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    task = build_task("elastictrain.toy:make_task", TASK_OPTIONS)
    sampler = GlobalBatchSampler(len(task.dataset), task.batch_size, 0)
    model = DDP(task.model)
    optimizer = task.make_optimizer(task.model.parameters())
    cpu = torch.device("cpu")
    loader = StepLoader(
        task=task,
        sampler=sampler,
        rank=rank,
        world_size=world,
        micro_steps=1,
        seed=0,
        start=0,
        stop=steps,
    )
    trainer = Trainer(
        task=task,
        model=model,
        optimizer=optimizer,
        scheduler=None,
        loader=loader,
        precision=Precision("fp32", cpu),
        device=cpu,
        rank=rank,
        seed=0,
    )
    trainer.prime_buckets(0)
    trainer.step(0)
    t0 = time.perf_counter()
    for step in range(1, steps):
        trainer.step(step)
    mean = (time.perf_counter() - t0) / (steps - 1)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_s": mean}, f)
    dist.destroy_process_group()
    # As the runner does (signals.py): torch 2.13 with gloo can abort a cleanly finished process
    # in interpreter teardown ("terminate called without an active exception"; seen here once).
    sys.stdout.flush()
    os._exit(0)


def _torchrun(args: list[str], workdir: str) -> None:
    env = child_env()
    path = os.path.join(workdir, "torchrun.log")
    with open(path, "ab") as log:
        start = log.tell()
        done = subprocess.run(
            torchrun(*args), env=env, stdout=log, stderr=subprocess.STDOUT, timeout=600
        )
    if done.returncode != 0:  # the log dies with the temp dir: show why before raising
        with open(path, "rb") as f:
            f.seek(start)
            print(f.read().decode(errors="replace")[-4000:], file=sys.stderr)
        done.check_returncode()


def _elastictrain_step_s(steps: int, workdir: str, i: str, *extra: str) -> float:
    from elastictrain.observe.events import read_events

    ev = os.path.join(workdir, f"ev{i}.jsonl")
    options = [a for k, v in TASK_OPTIONS.items() for a in ("--task-option", f"{k}={v}")]
    _torchrun(
        [
            "-m",
            "elastictrain",
            "--checkpoint-dir",
            os.path.join(workdir, f"c{i}"),
            "--checkpoint-every-steps",
            "0",
            "--max-steps",
            str(steps),
            "--event-log",
            ev,
            "--log-every-seconds",
            "1000",
            *options,
            *extra,
        ],
        workdir,
    )
    (end,) = [e for e in read_events(ev) if e["event"] == Event.END]
    return end["after_first_step_s"] / (steps - 1)


def heartbeat_cpu_s(rounds: int = 500) -> float:
    """CPU seconds one liveness beat costs a rank (its store requests, on a thread of their own,
    against a real TCPStore on loopback): the part of the heartbeat that competes with training,
    too small for the step-time ratios above to resolve on a noisy host."""
    from datetime import timedelta

    from elastictrain.cluster.liveness import Liveness

    server = dist.TCPStore(
        "127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False
    )
    ranks = [Liveness(r, 2, interval_s=2.0, silent_s=15.0) for r in range(2)]
    for r in ranks:
        r.announce(dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=30)))
    t0 = time.process_time()
    for _ in range(rounds):
        ranks[1].round()
    return (time.process_time() - t0) / rounds


def run(steps: int, repeats: int) -> dict[str, float]:
    ratios, local_ratios, live_ratios, ours, local, plain = [], [], [], [], [], []
    with tempfile.TemporaryDirectory() as workdir:
        for i in range(repeats):
            out = os.path.join(workdir, f"plain{i}.json")
            _torchrun(["-m", "elastictrain.bench.overhead", "--plain", str(steps), out], workdir)
            with open(out) as f:
                plain.append(json.load(f)["step_s"])
            ours.append(_elastictrain_step_s(steps, workdir, f"{i}", "--no-local-checkpoint"))
            if (
                repeats > 1
            ):  # one run's ratio is noise at this size: the suite's sanity run skips it
                unwatched = _elastictrain_step_s(
                    steps,
                    workdir,
                    f"{i}-unwatched",
                    "--no-local-checkpoint",
                    "--silent-timeout",
                    "0",
                )
                live_ratios.append(ours[-1] / unwatched)
            local.append(_elastictrain_step_s(steps, workdir, f"{i}-local"))
            ratios.append(ours[-1] / plain[-1])
            local_ratios.append(local[-1] / ours[-1])
    return {
        "steps": steps,
        "plain_step_s": statistics.median(plain),
        "elastictrain_step_s": statistics.median(ours),
        "with_local_tier_step_s": statistics.median(local),
        "runner_overhead": statistics.median(ratios) - 1,
        "local_tier_overhead": statistics.median(local_ratios) - 1,
        "liveness_overhead": statistics.median(live_ratios) - 1 if live_ratios else None,
        "heartbeat_cpu_s": heartbeat_cpu_s(),
    }


def _percent(ratio: float | None) -> str:
    return "n/a (--repeats 1)" if ratio is None else f"{ratio * 100:+.1f}%"


def main(steps: int, repeats: int, as_json: bool) -> int:
    r = run(steps, repeats)
    if as_json:
        print(json.dumps(r, indent=1))
    else:
        print(
            f"toy task {TASK_OPTIONS}, 2 workers, {steps} steps, median of {repeats}:\n"
            f"plain DDP loop   {r['plain_step_s'] * 1e3:8.3f} ms/step\n"
            f"elastictrain     {r['elastictrain_step_s'] * 1e3:8.3f} ms/step (no local tier)\n"
            f"+ local tier     {r['with_local_tier_step_s'] * 1e3:8.3f} ms/step (auto)\n"
            f"runner overhead  {r['runner_overhead'] * 100:+.1f}% (target <= 2%)\n"
            f"heartbeats       {_percent(r['liveness_overhead'])} (liveness; target <= 0.5%); "
            f"{r['heartbeat_cpu_s'] * 1e6:.0f} us of CPU a beat, "
            f"{r['heartbeat_cpu_s'] / 2.0 * 100:.3f}% of a core at one beat per 2 s\n"
            f"local tier       {r['local_tier_overhead'] * 100:+.1f}% (auto; target <= 2%)"
        )
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plain"]:
        plain_loop(int(sys.argv[2]), sys.argv[3])

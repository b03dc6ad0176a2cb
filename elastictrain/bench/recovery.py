"""``python -m elastictrain bench recovery``: where the time goes from a kill to training again.

Launches a real 2-worker ``torchrun --standalone`` job of the toy task (its state sized by
``--size``), waits for a checkpoint, SIGKILLs worker 1, and splits kill -> first step after resume:

- detect: until torchrun logs the failed worker
- restart: until the new worker process exists (torchrun stops the others and respawns)
- startup: the new worker's Python, torch and torch._dynamo import and task build, until
  process-group init
- init: process-group creation and the startup handshake
- probe, build, load: the storage probe, the model and optimizer build, the checkpoint load
- first step: the DDP wrap and the first training step

With ``--in-place`` it also runs ``bench.in_place``: in-place recovery beside restart-all on one
job of 4 ranks as 2 simulated nodes of 2. In the same run it measures a bare torchrun restart of a no-op script that only imports torch,
and the cold read bandwidth of the checkpoint file, for the target
``total <= 1.2 x (bare restart + checkpoint bytes / read bandwidth)``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import tempfile
import time
from typing import Any

from elastictrain.bench import in_place as bench_in_place
from elastictrain.bench.child import (
    Torchrun,
    child_env,
    drop_cache,
    events_in,
    first_step_after,
    toy_job_args,
    wait_for,
)
from elastictrain.observe.events import Event

_FAILED_LINE = re.compile(r"^[EW]\d{4} (\d\d:\d\d:\d\d\.\d+) .*failed \(exitcode", re.M)
_NOOP = """import os, time
import torch, torch.distributed  # what any training script pays at start
from elastictrain.observe.events import Event
with open(os.environ["ET_READY"], "a") as f:
    f.write(f"{os.environ['TORCHELASTIC_RESTART_COUNT']} {time.time()}\\n")
while True:
    time.sleep(1)
"""


def _failure_logged(log: str, after: float) -> float | None:
    today = datetime.date.today()
    for m in _FAILED_LINE.finditer(log):
        t = datetime.datetime.combine(today, datetime.time.fromisoformat(m.group(1))).timestamp()
        if t >= after - 1:
            return t
    return None


def _new_worker(job: Torchrun, old: set[int]) -> int | None:
    pid = job.workers().get(1)
    return pid if pid is not None and pid not in old else None


def _wait_checkpoint(ev: str, job: Torchrun) -> None:
    """Until the job has committed a checkpoint: the kill then has something to resume."""
    wait_for(
        lambda: any(e["event"] == Event.CHECKPOINT for e in events_in(ev)), 180, "a checkpoint", job
    )


def measure_elastictrain(workdir: str, size: int) -> dict[str, Any]:
    ckpt, ev = os.path.join(workdir, "ckpt"), os.path.join(workdir, "events.jsonl")
    job = Torchrun(toy_job_args(ckpt, ev, size), os.path.join(workdir, "job.log"), child_env())
    try:
        _wait_checkpoint(ev, job)
        old = set(job.workers().values())
        t_kill = time.time()
        os.kill(job.workers()[1], signal.SIGKILL)
        wait_for(lambda: _new_worker(job, old), 120, "a new worker", job)
        spawned = time.time()  # /proc's start time is only as exact as the boot time (1 s)
        first = first_step_after(ev, t_kill, 180, "the first step after resume", job)
        after = [e for e in events_in(ev) if e["time"] > t_kill]
        start = next(e for e in after if e["event"] == Event.START)
        resume = next(e for e in after if e["event"] == Event.RESUME)
        detected = _failure_logged(job.log(), t_kill) or spawned
        ckpt_bytes = resume["bytes"]
    finally:
        job.stop()
    init_begin = start["time"] - start["init_s"]
    return {
        "checkpoint_bytes": ckpt_bytes,
        "detect_s": detected - t_kill,
        "restart_s": spawned - detected,
        "startup_s": init_begin - spawned,
        "init_s": start["init_s"],
        "probe_s": first["probe_s"],
        "build_s": first["build_s"],
        "load_s": first["resume_s"],
        "first_step_s": first["ddp_s"] + first["step_s"],
        "total_s": first["time"] - t_kill,
        "read_gbps": _cold_read_gbps(ckpt),
    }


def _cold_read_gbps(ckpt: str) -> float:
    paths = [
        os.path.join(d, f) for d, _, files in os.walk(ckpt) for f in files if f.startswith("state-")
    ]
    path = max(paths, key=os.path.getsize)
    drop_cache(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(4 << 20):
            pass
    return os.path.getsize(path) / (time.perf_counter() - t0) / 1e9


def measure_bare(workdir: str) -> dict[str, float]:
    script, ready = os.path.join(workdir, "noop.py"), os.path.join(workdir, "ready.txt")
    with open(script, "w") as f:
        f.write(_NOOP)
    job = Torchrun([script], os.path.join(workdir, "noop.log"), {**child_env(), "ET_READY": ready})

    def ready_lines() -> list[list[str]]:
        with contextlib.suppress(FileNotFoundError), open(ready) as f:
            return [line.split() for line in f]
        return []

    try:
        wait_for(lambda: len(ready_lines()) >= 2, 120, "the no-op workers", job)
        old = set(job.workers().values())
        t_kill = time.time()
        os.kill(job.workers()[1], signal.SIGKILL)
        wait_for(lambda: _new_worker(job, old), 120, "a new no-op worker", job)
        spawned = time.time()
        lines = wait_for(
            lambda: [ln for ln in ready_lines() if ln[0] != "0" and float(ln[1]) > t_kill],
            120,
            "the restarted no-op workers",
            job,
        )
        detected = _failure_logged(job.log(), t_kill) or spawned
    finally:
        job.stop()
    return {
        "detect_s": detected - t_kill,
        "restart_s": spawned - detected,
        "total_s": max(float(ln[1]) for ln in lines) - t_kill,
    }


def run(
    size: int, in_place: bool = False, parallel: str = "ddp", spares: bool = False
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as workdir:
        ours = measure_elastictrain(workdir, size)
        bare = measure_bare(workdir)
        replaced = bench_in_place.run(workdir, size, parallel, spares) if in_place else None
    budget = bare["total_s"] + ours["checkpoint_bytes"] / (ours["read_gbps"] * 1e9)
    return {
        "elastictrain": ours,
        "bare_torchrun": bare,
        "target_s": 1.2 * budget,
        "ratio_to_bare_plus_read": ours["total_s"] / budget,
        **({"in_place": replaced} if replaced else {}),
    }


def table(r: dict[str, Any]) -> str:
    ours, bare = r["elastictrain"], r["bare_torchrun"]
    rows = [
        ("detect (torchrun logs the failed worker)", ours["detect_s"], bare["detect_s"]),
        ("restart (stop the others, respawn)", ours["restart_s"], bare["restart_s"]),
        ("startup (python, torch and torch._dynamo import, task build)", ours["startup_s"], None),
        ("process-group init", ours["init_s"], None),
        ("storage probe", ours["probe_s"], None),
        ("model + optimizer build", ours["build_s"], None),
        ("checkpoint load (read, broadcast, restore)", ours["load_s"], None),
        ("DDP wrap + first step", ours["first_step_s"], None),
        ("total: kill -> first step / no-op ready", ours["total_s"], bare["total_s"]),
    ]
    lines = [
        f"checkpoint {ours['checkpoint_bytes'] / 1e6:.1f} MB, cold read {ours['read_gbps']:.2f} GB/s",
        f"| {'phase':<46} | {'elastictrain':>12} | {'bare torchrun':>13} |",
        f"|{'-' * 48}|{'-' * 14}|{'-' * 15}|",
    ]
    for name, a, b in rows:
        shown_b = "" if b is None else f"{b:.3f} s"
        lines.append(f"| {name:<46} | {a:>10.3f} s | {shown_b:>13} |")
    lines.append(
        f"total / (bare restart + checkpoint / read bandwidth) = "
        f"{r['ratio_to_bare_plus_read']:.2f} (target <= 1.2)"
    )
    if "in_place" in r:
        lines += ["", bench_in_place.table(r["in_place"])]
    return "\n".join(lines)


def main(
    size: int, as_json: bool, in_place: bool = False, parallel: str = "ddp", spares: bool = False
) -> int:
    result = run(size, in_place, parallel, spares)
    print(json.dumps(result, indent=1) if as_json else table(result))
    return 0

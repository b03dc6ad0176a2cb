"""``python -m elastictrain bench tiers --remote-mbps 50``: what the local tier buys when the
durable tier is slow, side by side in one run.

The durable tier is ``throttled://`` (``throttled_fs``: a folder reached at ``--remote-mbps``
through the fsspec path S3 takes). Three real 2-worker ``torchrun --standalone`` jobs of the toy
task, its state sized by ``--size``, each step sleeping ``STEP_S`` on top of its CPU compute (a
stand-in for GPU compute, which leaves the CPU free), durable checkpoints every ``--every`` steps:

- ``durable``: ``--no-local-checkpoint``, today's behaviour;
- ``two_tiers``: the local tier on (``--local-every-steps`` from ``--local-every``, ``auto`` by
  default, under /dev/shm);
- ``empty``: nothing to resume from (no checkpoint before the kill): the floor of a restart.

Each is SIGKILLed (worker 1) halfway between two durable checkpoints, and reports: steps redone
(what the killed attempt had trained past the step it resumed from), kill -> first step, state
bytes read from the durable tier, and the step time before the kill (the local schedule's
overhead is ``two_tiers`` against ``durable``).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import tempfile
import time
from typing import Any

from elastictrain.bench.child import Torchrun, child_env, events_in, first_step_after, wait_for
from elastictrain.bench.throttled_fs import bytes_read
from elastictrain.observe.events import Event, read_sample_log

EVERY = 100  # durable checkpoint interval, in steps
STEP_S = 0.05  # each step also sleeps this long: the GPU compute a CPU-only run does not do
MODES = {
    "durable": ["--no-local-checkpoint"],
    "two_tiers": [],
    "empty": ["--no-local-checkpoint"],
}


def _trained(samples: str) -> int:
    """Steps the job has trained so far (rank 0's ledger)."""
    rows = read_sample_log(samples) if os.path.isdir(samples) else []
    return max((e["step"] + 1 for e in rows if e["rank"] == 0), default=0)


STATE_FILES = {"ddp": ("/state-",), "fsdp": ("/shard-", "/common-", "/index-", "/part-")}
"""The durable tier's files that hold state (manifests left out)."""


def measure(
    workdir: str,
    mode: str,
    size: int,
    remote_bps: float,
    parallel: str = "ddp",
    durable_every: int = EVERY,
    local_every: str = "auto",
) -> dict[str, Any]:
    layers = max(1, round(size / (8 * 1024 * 1024)))  # weights + momentum of 1024x1024 layers
    base = os.path.join(workdir, mode)
    ev, samples, log = base + "-events.jsonl", base + "-samples", base + "-reads.tsv"
    every = 10**9 if mode == "empty" else durable_every
    args = [
        "-m",
        "elastictrain",
        "--checkpoint-dir",
        f"throttled://{base}-ckpt",
        "--task",
        "elastictrain.bench.throttled_fs:make_task",
        "--event-log",
        ev,
        "--sample-log",
        samples,
        "--max-steps",
        "1000000",
        "--log-every-seconds",
        "0.5",
        "--checkpoint-every-steps",
        str(every),
        "--keep-last",
        "2",
        "--task-option",
        "hidden=1024",
        "--task-option",
        f"layers={layers}",
        "--task-option",
        "batch_size=32",
        "--task-option",
        f"step_time={STEP_S}",
        "--parallel",
        parallel,
        *MODES[mode],
    ]
    if mode == "two_tiers":
        args += ["--local-every-steps", local_every]
    env = {**child_env(), "ET_THROTTLE_BPS": str(remote_bps), "ET_THROTTLE_LOG": log}
    job = Torchrun(args, base + "-job.log", env)
    # Halfway between the first two durable checkpoints; with none, early (only the restart counts).
    kill_at = 20 if mode == "empty" else durable_every + durable_every // 2
    try:
        if mode != "empty":
            wait_for(
                lambda: any(e["event"] == Event.CHECKPOINT for e in events_in(ev)),
                600,
                "the first durable checkpoint",
                job,
            )
        wait_for(lambda: _trained(samples) >= kill_at, 600, f"step {kill_at}", job)
        rates = [e["steps_per_s"] for e in events_in(ev) if e["event"] == Event.PROGRESS]
        reads_before = bytes_read(log, STATE_FILES[parallel])
        t_kill = time.time()
        os.kill(job.workers()[1], signal.SIGKILL)
        first = first_step_after(ev, t_kill, 600, "the first step after the kill", job)
        resume = next(e for e in events_in(ev) if e["event"] == Event.RESUME and e["time"] > t_kill)
        killed_at = _trained_by_the_killed_attempt(samples)
    finally:
        job.stop()
    resumed = resume["step"]
    return {
        "resumed_step": resumed,
        "checkpoint_bytes": resume.get("bytes", 0),
        "tier": resume.get("tier", "none"),
        "steps_redone": killed_at - resumed,
        "kill_to_first_step_s": round(first["time"] - t_kill, 3),
        "remote_state_bytes_read": bytes_read(log, STATE_FILES[parallel]) - reads_before,
        # None when the job reached the kill before its second progress line (a tiny state).
        "step_s_before_kill": round(1 / statistics.median(rates[1:]), 4) if rates[1:] else None,
    }


def _trained_by_the_killed_attempt(samples: str) -> int:
    """The killed attempt's last step (its generation is the oldest in the ledger)."""
    rows = read_sample_log(samples)
    first = min(e["generation"] for e in rows)
    return max(e["step"] + 1 for e in rows if e["generation"] == first)


def run(
    size: int,
    remote_mbps: float,
    repeats: int,
    parallel: str = "ddp",
    every: int = EVERY,
    local_every: str = "auto",
) -> dict[str, Any]:
    """Each mode ``repeats`` times, the modes interleaved (restart times here vary by seconds
    from run to run); each figure is the median."""
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as workdir:
        for i in range(repeats):
            for mode in MODES:
                where = os.path.join(workdir, str(i))
                os.makedirs(where, exist_ok=True)
                runs[mode].append(
                    measure(where, mode, size, remote_mbps * 1e6, parallel, every, local_every)
                )
    result: dict[str, Any] = {mode: _medians(runs[mode]) for mode in MODES}
    result["runs"] = runs
    durable, local, empty = result["durable"], result["two_tiers"], result["empty"]
    result["state_mb"] = size / 1e6
    result["remote_mbps"] = remote_mbps
    result["repeats"] = repeats
    result["parallel"] = parallel
    result["every"] = every
    result["local_every"] = local_every
    result["restart_over_empty"] = {
        mode: round(result[mode]["kill_to_first_step_s"] / empty["kill_to_first_step_s"], 3)
        for mode in ("durable", "two_tiers")
    }
    timed = local["step_s_before_kill"] and durable["step_s_before_kill"]
    result["local_step_overhead"] = (
        round(local["step_s_before_kill"] / durable["step_s_before_kill"] - 1, 4) if timed else None
    )
    return result


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for key, value in runs[0].items():
        values = [r[key] for r in runs]
        numeric = all(isinstance(v, (int, float)) for v in values)
        out[key] = statistics.median(values) if numeric else value
    return out


def table(r: dict[str, Any]) -> str:
    rows = [
        ("steps redone after the SIGKILL", "steps_redone", "{:g}"),
        ("kill -> first step (s)", "kill_to_first_step_s", "{:.2f}"),
        ("state bytes read from the durable tier (MB)", "remote_state_bytes_read", None),
        ("step time before the kill (s)", "step_s_before_kill", "{:.4f}"),
        ("resumed from (tier, step)", None, None),
    ]
    held = max(r[mode]["checkpoint_bytes"] for mode in MODES)
    lines = [
        f"{r.get('parallel', 'ddp')}: state {held / 1e6:.0f} MB, durable tier at {r['remote_mbps']:g} MB/s, durable "
        f"checkpoints every {r['every']} steps, steps sleep {STEP_S * 1e3:.0f} ms on top of their "
        f"compute, SIGKILL at step ~{r['every'] * 3 // 2}; medians of {r['repeats']} runs each",
        f"| {'figure':<44} | {'durable only':>12} | {'two tiers':>12} | {'no checkpoint':>13} |",
        f"|{'-' * 46}|{'-' * 14}|{'-' * 14}|{'-' * 15}|",
    ]
    for name, key, fmt in rows:
        cells = []
        for mode in MODES:
            m = r[mode]
            if key is None:
                cells.append(f"{m['tier']} {m['resumed_step']:g}")
            elif m[key] is None:
                cells.append("-")
            elif fmt is None:
                cells.append(f"{m[key] / 1e6:.1f}")
            else:
                cells.append(fmt.format(m[key]))
        lines.append(f"| {name:<44} | {cells[0]:>12} | {cells[1]:>12} | {cells[2]:>13} |")
    ratio = r["restart_over_empty"]
    lines.append(
        f"kill -> first step / the same restart with nothing to load: durable only "
        f"{ratio['durable']:.2f}, two tiers {ratio['two_tiers']:.2f} (target <= 1.2)"
    )
    if r["local_step_overhead"] is not None:
        lines.append(
            f"step-time overhead of the local tier ({r.get('local_every', 'auto')}): "
            f"{r['local_step_overhead'] * 100:+.1f}%"
            " (target <= 2%; median of the progress lines before the kill, noisy here)"
        )
    return "\n".join(lines)


def main(
    size: int,
    remote_mbps: float,
    repeats: int,
    as_json: bool,
    parallel: str = "ddp",
    every: int = EVERY,
    local_every: str = "auto",
) -> int:
    result = run(size, remote_mbps, repeats, parallel, every, local_every)
    print(json.dumps(result, indent=1) if as_json else table(result))
    return 0

"""SIGKILL rank 0 while it is persisting a checkpoint, over and over, under one torchrun job.

``tier``: ``durable`` aims at the writes to ``--checkpoint-dir`` (the local tier off);
``local`` at the local tier's writes (every 10 steps, under /dev/shm), where every resume must come
from the newest committed local copy and read no state from the durable tier.

Each trial lets the restarted job commit one checkpoint, waits until the next one is half-written (its step directory holds payload bytes but no
manifest), SIGKILLs rank 0 at a random moment inside that window, and then checks:

- the half-written step is not committed, and every committed checkpoint verifies
  (no committed-but-incomplete checkpoint, ever);
- torchrun's restart resumes from the newest committed checkpoint.

Scheduled checkpoints are persisted in the background (the default), so every kill lands while
rank 0's persist thread is writing and its training thread has moved on.

A kill that lands after the manifest was written is not counted as "during persist"; the loop goes
on until ``trials`` kills landed inside the window. Used by the test suite, and runnable by hand:

    python -m tests.helpers.kill_during_persist --trials 20
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from typing import Any

import storage
from elastictrain.observe.events import Event
from storage.manifest import MANIFEST_NAME, parse_step_dir, step_dir_name
from tests.helpers.launcher import Job
from tests.helpers.restart_loop import count_events, wait_for_count

# About 32 MB of state, frozen weights the toy carries: writing and fsyncing it takes long
# enough to aim at, and no step computes on it (a trained model this size made each attempt's
# steps cost 45 ms of CPU at 2 ranks, most of these trials' and test_in_place.py's CPU).
TOY = ("frozen_mb=32", "batch_size=32")


def _is_payload(name: str) -> bool:
    """A payload file, published (``state-g<gen>.bin``) or still being written under its
    temporary name (``.state-g<gen>.bin.tmp-<uuid>``: write-once publishes it whole, at the end)."""
    return name.startswith(("state-", ".state-"))


def _payload_files(ckpt: str) -> set[str]:
    return {
        os.path.join(name, f)
        for name in (os.listdir(ckpt) if os.path.isdir(ckpt) else [])
        if parse_step_dir(name) is not None
        for f in (
            os.listdir(os.path.join(ckpt, name)) if os.path.isdir(os.path.join(ckpt, name)) else []
        )
        if _is_payload(f)
    }


def _half_written(ckpt: str, leftovers: set[str]) -> int | None:
    """A step newer than every committed one whose directory holds a new payload file but no
    manifest: one being written right now.

    Newer, because retention deleting an old step (manifest first) looks half-written too; new,
    because an earlier trial's killed write leaves its file behind (``leftovers``).
    """
    try:
        names = os.listdir(ckpt)
    except FileNotFoundError:
        return None
    committed, partial = [], []
    for name in names:
        step = parse_step_dir(name)
        if step is None:
            continue
        try:
            files = os.listdir(os.path.join(ckpt, name))
        except FileNotFoundError:
            continue
        if MANIFEST_NAME in files:
            committed.append(step)
        elif any(_is_payload(f) and os.path.join(name, f) not in leftovers for f in files):
            partial.append(step)
    newer = [s for s in partial if s > max(committed, default=-1)]
    return max(newer) if newer else None


def _wait_half_written(ckpt: str, timeout: float, job: Job) -> int:
    leftovers = _payload_files(ckpt)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        step = _half_written(ckpt, leftovers)
        if step is not None:
            return step
        if job.proc.poll() is not None:
            raise AssertionError(f"torchrun exited ({job.proc.returncode}):\n{job.log()[-3000:]}")
        time.sleep(0.002)
    raise AssertionError(f"no checkpoint was being written within {timeout}s")


def run_trials(
    workdir: str,
    trials: int,
    *,
    seed: int = 0,
    max_attempts: int | None = None,
    tier: str = "durable",
):
    rng = random.Random(seed)
    durable, events = os.path.join(workdir, "ckpt"), os.path.join(workdir, "events.jsonl")
    max_attempts = max_attempts or trials * 2
    if tier == "local":
        root = os.environ.get("ELASTICTRAIN_LOCAL_ROOT", "/dev/shm")
        ckpt = tempfile.mkdtemp(prefix="kill-trials-", dir=root)  # the writes aimed at
        tier_args = ["--local-checkpoint-dir", ckpt, "--local-every-steps", "10"]
        every, written_event = "200", Event.LOCAL_CHECKPOINT
    else:
        ckpt, tier_args = durable, ["--no-local-checkpoint"]
        every, written_event = "10", Event.CHECKPOINT
    # The local tier's writer is each node's local rank 0: one worker is a node (and half the
    # CPU of each restart, which is what these trials spend).
    nproc = 1 if tier == "local" else 2
    job = Job(
        ["--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={max_attempts + 1}"],
        [
            "--checkpoint-dir",
            durable,
            "--event-log",
            events,
            "--max-steps",
            "1000000",
            "--checkpoint-every-steps",
            every,
            "--keep-last",
            "2",
            *tier_args,
            *(arg for opt in TOY for arg in ("--task-option", opt)),
            # Paced as the trained model of that size paced itself: a persist every half second.
            *("--task-option", "step_time=0.04"),
        ],
        os.path.join(workdir, "torchrun.log"),
        cwd=workdir,
        env=None,
    )
    store = storage.open_store(ckpt)
    results: list[dict[str, Any]] = []
    try:
        attempt = 0
        while sum(r["during_persist"] for r in results) < trials:
            attempt += 1
            if attempt > max_attempts:
                raise AssertionError(f"only {len(results)} kills in {max_attempts} attempts")
            wait_for_count(events, Event.RESUME, attempt, 120, job)
            # Let this attempt commit one checkpoint first, so every resume has one to find and
            # retention runs; then aim at the next one.
            wait_for_count(
                events, written_event, len(count_events(events, written_event)) + 1, 120, job
            )
            rank0 = job.workers()[0]
            step = _wait_half_written(ckpt, 120, job)
            time.sleep(rng.uniform(0, 0.03))  # somewhere inside the write, not always its start
            os.kill(rank0, 9)
            _wait_dead(rank0)
            written = _new_payload_bytes(ckpt, step)
            committed_after = store.committed_steps()
            listed = store.list()  # verifies every committed checkpoint's sizes and checksums
            bad = [c.step for c in listed if not c.ok]
            resumed = wait_for_count(events, Event.RESUME, attempt + 1, 120, job)
            newest = max(committed_after) if committed_after else 0
            results.append(
                {
                    "trial": attempt,
                    "killed_writing_step": step,
                    "payload_bytes_on_disk": written,
                    "during_persist": step not in committed_after,
                    "committed_but_incomplete": bad,
                    "newest_committed": newest,
                    "resumed_from": resumed["step"],
                    "resumed_tier": resumed.get("tier"),
                    "remote_bytes": resumed.get("remote_bytes"),
                }
            )
            wrong_tier = tier == "local" and (resumed["tier"], resumed["remote_bytes"]) != (
                "local",
                0,
            )
            if bad or resumed["step"] != newest or wrong_tier:
                raise AssertionError(f"trial went wrong: {results[-1]}\n{job.log()[-3000:]}")
    finally:
        job.kill()
        if tier == "local":
            shutil.rmtree(ckpt, ignore_errors=True)
    corrupt_logged = "CORRUPT CHECKPOINT" in job.log()
    full = max((e["bytes"] for e in count_events(events, written_event)), default=None)
    written = sorted(
        r["payload_bytes_on_disk"] / full for r in results if r["during_persist"] and full
    )
    return {
        "kills": len(results),
        "during_persist": sum(r["during_persist"] for r in results),
        "committed_but_incomplete": sum(len(r["committed_but_incomplete"]) for r in results),
        "resumed_from_newest_committed": sum(
            r["resumed_from"] == r["newest_committed"] for r in results
        ),
        "resumed_from_the_local_tier_reading_no_remote_state": sum(
            (r["resumed_tier"], r["remote_bytes"]) == ("local", 0) for r in results
        ),
        "corrupt_checkpoint_logged": corrupt_logged,
        "restarts": len(count_events(events, Event.START)) - 1,
        "checkpoint_bytes": full,
        # How far the killed write had got: 1.0 means the payload was whole but not yet committed.
        "payload_written_at_kill": {
            "min": round(written[0], 3),
            "median": round(written[len(written) // 2], 3),
            "max": round(written[-1], 3),
        }
        if written
        else None,
        "trials": results,
    }


def _new_payload_bytes(ckpt: str, step: int) -> int:
    """Bytes of the newest payload file in ``step``'s directory (the one being written)."""
    step_dir = os.path.join(ckpt, step_dir_name(step))
    stats = []
    for name in os.listdir(step_dir) if os.path.isdir(step_dir) else []:
        if _is_payload(name):
            with contextlib.suppress(FileNotFoundError):  # a temporary name, published since
                stats.append(os.stat(os.path.join(step_dir, name)))
    return max(stats, key=lambda st: st.st_mtime_ns).st_size if stats else 0


def _wait_dead(pid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.005)
    raise AssertionError(f"rank 0 (pid {pid}) still alive {timeout}s after SIGKILL")


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tier", choices=["durable", "local"], default="durable")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        try:
            result = run_trials(d, args.trials, seed=args.seed, tier=args.tier)
        except AssertionError as e:
            print(f"FAILED: {e}", file=sys.stderr)
            return 1
    print(json.dumps({k: v for k, v in result.items() if k != "trials"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Manual (docs/scale.md): W real workers of the toy task on this host, one SIGKILLed after the first
checkpoint, must end bitwise equal to an uninterrupted run at the same W.

    python -m tests.helpers.bitwise_at_scale 32
    python -m tests.helpers.bitwise_at_scale 16 --parallel fsdp
"""

from __future__ import annotations

import sys
import tempfile
import time

from elastictrain.observe.events import Event, read_events
from tests.helpers.launcher import Job, assert_bitwise_equal, final_state, toy_args, wait_for_event


def main(world: int, extra: list[str]) -> None:
    flags = ("--no-local-checkpoint", "--init-timeout", "600", *extra)
    torchrun = ["--standalone", f"--nproc_per_node={world}", "--max-restarts=3"]
    with tempfile.TemporaryDirectory() as base:
        t0 = time.time()
        args = toy_args(f"{base}/ref", f"{base}/ref.jsonl", max_steps=60, every=20, step_time=0,
                        extra=flags)  # fmt: skip
        ref = Job(torchrun, args, f"{base}/ref.log", base)
        assert ref.wait(900) == 0, ref.log()[-2000:]
        t1, ev = time.time(), f"{base}/run.jsonl"
        args = toy_args(f"{base}/run", ev, max_steps=60, every=20, step_time=0.05, extra=flags)
        job = Job(torchrun, args, f"{base}/run.log", base)
        try:
            wait_for_event(ev, lambda e: e["event"] == Event.CHECKPOINT, 900, job)
            job.kill_worker(world - 1)
            assert job.wait(900) == 0, job.log()[-2000:]
        finally:
            if job.proc.poll() is None:
                job.kill()
        resumes = [e["step"] for e in read_events(ev) if e["event"] == Event.RESUME]
        assert_bitwise_equal(final_state(f"{base}/run"), final_state(f"{base}/ref"))
    print(f"W={world} {' '.join(extra)}: resumed from steps {resumes}; bitwise equal to the "
          f"uninterrupted run (it took {t1 - t0:.0f} s; the killed one {time.time() - t1:.0f} s)")  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])

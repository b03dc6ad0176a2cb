"""Library mode, FSDP over 2 spawned gloo processes: ``step(N)`` saves N in the background, then
the common ``save(N)`` after the loop saves it again, and rank 1 is SIGKILLed 10 ms later (as
torchrun's teardown or the OOM killer would end it). Storage is ``throttled://`` at 5 MB/s, so
any write of rank 1's shard is still in flight when the kill lands: the window the 0-byte shard
of issue 44 came through. ``tests/integration/test_write_once.py`` checks the committed step."""

from __future__ import annotations

import os
import signal
import time
import traceback
from datetime import timedelta

STEPS = 4


def worker(rank: int, world: int, port: int, url: str, out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), ET_THROTTLE_BPS=str(5e6))  # fmt: skip
    try:
        import torch.distributed as dist

        import elastictrain.bench.throttled_fs  # noqa: F401  registers throttled://
        import storage
        from elastictrain import CheckpointManager
        from tests.helpers.fsdp_probe import build, train_step

        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        model, optimizer = build(width=256)
        ckpt = CheckpointManager(
            url, checkpoint_every_steps=STEPS, local_checkpoint=False, preempt_signals=()
        )
        ckpt.resume(model, optimizer)
        for step in range(STEPS):
            train_step(model, optimizer, step)
            ckpt.step(step + 1, model, optimizer)
        committed = storage.open_store(url)
        deadline = time.monotonic() + 60
        while not committed.is_committed(STEPS) and time.monotonic() < deadline:
            time.sleep(0.02)
        dist.barrier()  # step N is committed, as rank 0's background persist left it
        ckpt.save(STEPS, model, optimizer)
        out.put(("saved", rank))
        if rank == 1:
            time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # rank 0: killed by the test once rank 1 is gone
    except Exception:
        out.put(("error", rank, traceback.format_exc()))

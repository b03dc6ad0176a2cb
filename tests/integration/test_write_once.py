"""A committed step survives a second save of it and a kill in the middle (docs/checkpoints.md,
"Write-once"): library mode, FSDP at 2 real processes (spawned, gloo), ``step(N)`` then
``save(N)``, and rank 1 SIGKILLed 10 ms later. Before write-once the second save rewrote rank
1's shard through a truncating open, and the kill left the committed step with an empty shard."""

from __future__ import annotations

import os
import signal

import torch.multiprocessing as mp

import elastictrain.bench.throttled_fs  # noqa: F401  registers throttled://
import storage
from tests.helpers import save_twice
from tests.helpers.committed_files import CommittedFiles
from tests.helpers.net import free_port


def test_library_fsdp_step_then_save_of_one_step_and_a_kill_10ms_later_keeps_it_whole(tmp_path):
    folder = tmp_path / "ckpt"
    url = f"throttled://{folder}"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    with CommittedFiles(folder) as files:
        procs = [
            ctx.Process(target=save_twice.worker, args=(rank, 2, port, url, out))
            for rank in range(2)
        ]
        for p in procs:
            p.start()
        try:
            said = [out.get(timeout=120) for _ in range(2)]
            assert all(s[0] == "saved" for s in said), said
            procs[1].join(30)
            assert procs[1].exitcode == -signal.SIGKILL
            procs[0].join(0.5)  # rank 0's persist thread gets its chance to act on the step
        finally:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
                p.join(10)
    files.check()
    kept = storage.open_store(str(folder)).read(save_twice.STEPS)  # every file verifies
    assert {n.split("-")[0] for n in kept.files} == {"shard", "part", "common", "index"}

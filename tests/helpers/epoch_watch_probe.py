"""One rank of a 2-rank gloo group on the test's TCPStore, for ``tests/unit/test_epoch_end.py``.

Rank 0 watches its epoch (``epoch_end.EpochWatch``) and enters an all-reduce; rank 1 stays alive
with its connections open and never joins it, as a peer wedged behind a dead one does (on NCCL,
every survivor of a death). Rank 0 prints, as one JSON line, how long its all-reduce took to fail
and whether the error reads as a peer's loss.

    python -m tests.helpers.epoch_watch_probe RANK STORE_PORT NONCE
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elastictrain import epoch_end, membership


def main() -> None:
    rank, port, nonce = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"{nonce}/pg/", store),
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=120),
    )
    if rank == 1:
        print("ready", flush=True)
        time.sleep(120)  # alive, connections open, never in the collective
        return
    epoch_end.EpochWatch(store, nonce, keep_port=port).start()
    print("ready", flush=True)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        out = {"raised": False}
    except Exception as e:
        out = {"raised": True, "after_s": time.monotonic() - t0}
        out["peer_loss"] = membership.is_peer_loss(e)
        out["silent"] = epoch_end.heard_silent()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

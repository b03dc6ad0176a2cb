"""Library mode, 2 ranks: a scheduled checkpoint commits in the background, then the final save
comes at the same step. Rank 0 knows that step is committed; rank 1 cannot. Run under torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.helpers.final_after_background URL

Each rank prints ``PROBE {"rank": r, "final": true}`` once its final save returned; exit 0."""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from elastictrain import CheckpointManager, init_distributed


def main() -> int:
    init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = CheckpointManager(sys.argv[1], checkpoint_every_steps=4, local_checkpoint=False)
    ckpt.resume(model, optimizer)
    for step in range(4):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        ckpt.step(step + 1, model, optimizer)
    deadline = time.monotonic() + 60
    while rank == 0 and ckpt.last_committed != 4 and time.monotonic() < deadline:
        time.sleep(0.02)  # step 4's background commit has landed: rank 0 knows, rank 1 does not
    dist.barrier()
    final = ckpt.save(4, model, optimizer, final=True)
    ckpt.close()
    print("PROBE " + json.dumps({"rank": rank, "final": final}), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    dist.destroy_process_group()
    from elastictrain.runtime.signals import exit_without_teardown

    exit_without_teardown(code)

"""How much memory ``export`` needs: it must stream, a tensor at a time.

    python -m tests.helpers.export_memory make URL MB        a committed checkpoint of a model of
                                                            about MB (10 MB tensors) and its AdamW
                                                            moments; under torchrun, FSDP-sharded
    python -m tests.helpers.export_memory export URL OUT     export it; print one JSON line: the
                                                            peak RSS the export added, the largest
                                                            tensor and the model, in MB

The peak is ``ru_maxrss`` after the export less its value once everything is imported (and fake
tensors, which the ``.pt`` writer uses, were used once: ~70 MB of lazily loaded code), so it counts
only what the export itself held.
"""

from __future__ import annotations

import json
import os
import resource
import sys

import torch
from torch import nn

TENSOR_MB = 10


def make(url: str, megabytes: int) -> None:
    from elastictrain import CheckpointManager, init_distributed

    sharded = "WORLD_SIZE" in os.environ
    if sharded:
        init_distributed()
    width = int((TENSOR_MB * 1e6 / 4) ** 0.5)
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Linear(width, width, bias=False) for _ in range(max(megabytes // TENSOR_MB, 1)))
    )
    if sharded:
        import torch.distributed as dist

        from elastictrain.train.parallel import shard

        shard(model, None, torch.device("cpu"), dist.get_world_size())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()  # the moments exist: the checkpoint is 3x the model, export reads 1x
    manager = CheckpointManager(url, keep_last=1, local_checkpoint=False)
    manager.resume(model, optimizer)
    manager.save(1, model, optimizer, final=True)
    manager.close()


def export(url: str, out: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from elastictrain.checkpoint.readers.model import open_model
    from elastictrain.tools import export as tool

    with FakeTensorMode():  # .pt's writer: its first use costs ~70 MB of code, whatever the model
        torch.empty(1)

    model = open_model(url)  # reads only metadata; imports what the export needs
    largest = max(info.nbytes for info in model.tensors.values())
    total = sum(info.nbytes for info in model.tensors.values())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert tool.main([url, "-o", out]) == 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        "EXPORT_MEMORY "
        + json.dumps(
            {
                "added_mb": round((peak - before) / 1e6, 1),
                "largest_tensor_mb": round(largest / 1e6, 1),
                "model_mb": round(total / 1e6, 1),
            }
        )
    )


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2], int(sys.argv[3]))
    else:
        export(sys.argv[2], sys.argv[3])

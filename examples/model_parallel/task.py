"""Model parallel + DDP, as in PyTorch's "Getting started with DDP" tutorial: each process holds one
``ToyMpModel`` whose two layers live on two different GPUs, and DDP (with ``device_ids=None``)
synchronises the gradients across processes. The task declares ``model_devices``, so the runner
leaves the placement alone.

GPU machine with 2 GPUs per process (4 GPUs, 2 processes):
    torchrun --standalone --nproc_per_node=2 -m elastictrain \
        --task examples.model_parallel.task:make_task --checkpoint-dir ./checkpoints-mp
Without two GPUs per process, both halves run on the CPU and rank 0 says so once: the same code
path (a module that is not moved, DDP with device_ids=None), only without the device hops.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import nn

from elastictrain import Task
from elastictrain.cluster.env import read_env
from elastictrain.toy import synthetic_dataset

logger = logging.getLogger(__name__)


class ToyMpModel(nn.Module):
    """The tutorial's model: net1 on dev0, net2 on dev1; activations hop between them."""

    def __init__(self, dev0: torch.device, dev1: torch.device) -> None:
        super().__init__()
        self.dev0, self.dev1 = dev0, dev1
        self.net1 = nn.Linear(10, 10).to(dev0)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5).to(dev1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.net1(x.to(self.dev0)))
        return self.net2(x.to(self.dev1))


def devices_for_this_process() -> tuple[torch.device, torch.device]:
    """Two GPUs per local process (local rank r gets cuda:2r and cuda:2r+1), else the CPU twice."""
    env = read_env()
    per_node = env.local_world_size
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have >= 2 * per_node:
        return torch.device("cuda", 2 * env.local_rank), torch.device(
            "cuda", 2 * env.local_rank + 1
        )
    if env.rank == 0:
        logger.warning(
            "model_parallel: needs 2 GPUs per process (%d processes on this node, %d GPUs found); "
            "running both halves of ToyMpModel on the CPU instead",
            per_node,
            have,
        )
    cpu = torch.device("cpu")
    return cpu, cpu


def make_task(options: Mapping[str, str]) -> Task:
    dev0, dev1 = devices_for_this_process()
    mse = nn.MSELoss()
    return Task(
        model=ToyMpModel(dev0, dev1),
        model_devices=[dev0, dev1],
        dataset=synthetic_dataset(int(options.get("dataset_size", 4096))),
        batch_size=int(options.get("batch_size", 64)),
        make_optimizer=lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
        loss_fn=lambda model, batch: mse(model(batch[0]), batch[1].to(dev1)),  # labels meet outputs
    )

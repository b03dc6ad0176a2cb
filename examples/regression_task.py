"""A complete user task: copy this file, change the model/data, launch with --task.

    torchrun --standalone --nproc_per_node=2 -m elastictrain \
        --task examples.regression_task:make_task --task-option width=64 --max-steps 500

The runner owns devices, DDP, sampling, seeding, checkpoints and resume; this file only says what
to train. Everything here must be deterministic given the options (every rank builds the same task).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.utils.data import Dataset

from elastictrain import Task


class NoisySine(Dataset):
    """A map-style dataset: len() and [i]. Any torch Dataset with those two works."""

    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.rand(size, 1, generator=g) * 6.28
        self.y = torch.sin(self.x) + 0.05 * torch.randn(size, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def make_task(options: Mapping[str, str]) -> Task:
    width = int(options.get("width", 64))
    model = nn.Sequential(nn.Linear(1, width), nn.Tanh(), nn.Dropout(0.1), nn.Linear(width, 1))
    loss = nn.MSELoss()  # mean over the batch it is given; the runner rescales across ranks
    return Task(
        model=model,
        dataset=NoisySine(int(options.get("dataset_size", 2048))),
        batch_size=int(options.get("batch_size", 128)),  # global batch, whatever the world size
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        make_scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000),
        loss_fn=lambda model, batch: loss(model(batch[0]), batch[1]),
    )

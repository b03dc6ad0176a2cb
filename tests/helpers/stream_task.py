"""Tasks whose dataset is a stream (``IterableDataset``), for the runner's stream tests.

Sample ``p`` of the global stream is a pure function of ``p``: ``(x, y, p)``, so a test can tell
exactly which samples were trained. Options:
- ``stream``: ``seekable`` (state_dict/load_state_dict and seek: exact anywhere), ``stateful``
  (state_dict/load_state_dict only: exact at the same world size), ``plain`` (neither: refused);
- ``step_time`` (0 s), ``dropout`` (0.2).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset, get_worker_info

from elastictrain import Task
from elastictrain.task import option

FEATURES = 10


def sample(p: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    t = torch.arange(FEATURES, dtype=torch.float32)
    x = torch.sin(0.37 * p + t) + 0.1 * torch.cos(0.011 * p * (t + 1))
    return x, x[:3].sum(0, keepdim=True) - x[5:].mean(0, keepdim=True), p


class PlainStream(IterableDataset):
    """An endless stream; each rank reads every world_size-th sample (from RANK/WORLD_SIZE, as
    WebDataset's split_by_node does) and each loader worker every num_workers-th of those."""

    def __init__(self) -> None:
        self.position = 0
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.done = 0  # samples this rank (this worker, in a loader worker) has yielded

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        while True:
            local = worker + workers * self.done
            self.done += 1
            yield sample(self.position + self.rank + self.world * local)


class StatefulStream(PlainStream):
    def state_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "rank": self.rank,
            "world": self.world,
            "done": self.done,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position, self.rank, self.world = state["position"], state["rank"], state["world"]
        self.done = state["done"]


class SeekableStream(StatefulStream):
    def seek(self, position: int, rank: int, world_size: int) -> None:
        self.position, self.rank, self.world, self.done = position, rank, world_size, 0


STREAMS = {"plain": PlainStream, "stateful": StatefulStream, "seekable": SeekableStream}


def make_task(options: Mapping[str, str]) -> Task:
    step_time = option(options, "step_time", 0.0, float)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(FEATURES, 32),
        nn.ReLU(),
        nn.Dropout(option(options, "dropout", 0.2, float)),
        nn.Linear(32, 1),
    )
    mse = nn.MSELoss()

    def loss_fn(m: nn.Module, batch):
        x, y, _ = batch
        time.sleep(step_time)
        return mse(m(x), y)

    return Task(
        model=model,
        dataset=STREAMS[options.get("stream", "seekable")](),
        batch_size=12,
        make_optimizer=lambda p: torch.optim.AdamW(p, lr=0.01),
        loss_fn=loss_fn,
    )

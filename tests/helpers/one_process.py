"""A one-process gloo world, a small model and its training state: the checkpoint layers' unit tests run the
real collectives (broadcasts, barriers, all-gathers) without torchrun."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastictrain.checkpoint.state.train_state import TrainState
from elastictrain.cluster.env import DistEnv, read_env
from elastictrain.observe.events import EventLog


@pytest.fixture
def gloo_world() -> Iterator[dist.ProcessGroup]:
    """The default group: this process alone, over an in-memory store. Destroyed afterwards, so the
    next test in this worker starts without one."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def memory_url() -> str:
    """A fresh location in fsspec's in-process memory filesystem."""
    return f"memory://et-unit/{uuid.uuid4().hex}"


def build(seed: int = 0, width: int = 8):
    """A small model, Adam and a StepLR: library mode's tests and the format-1 fixture."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    return model, opt, sched


def train_step(model, opt, sched, step: int) -> float:
    """One optimizer step whose batch depends on ``step`` alone; the loss."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 4, generator=g)
    opt.zero_grad()
    loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def state(seed: int = 0, width: int = 8) -> TrainState:
    model, optimizer, _ = build(seed, width)
    return TrainState(model, optimizer)


def train(s: TrainState, step: int) -> None:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
    s.optimizer.zero_grad()
    (s.model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean().backward()
    s.optimizer.step()


def same_weights(a: TrainState, b: TrainState) -> bool:
    return all(
        x.equal(y)
        for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values(), strict=True)
    )


def one_rank() -> DistEnv:
    return read_env({})


def events(path: str) -> EventLog:
    return EventLog(path, enabled=True)

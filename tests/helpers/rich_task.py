"""A toy task with what real jobs add: dropout, an EMA of the weights in ``Task.state`` (updated
in ``after_step``), Python's ``random`` and NumPy noise inside ``loss_fn``, task metrics, and an
eval hook. Every source of randomness is one the runner reseeds per step, so resume is exact.

Options: dropout (0.2), ema (0.9 decay; 0 off), noise (1: jitter inputs with random and NumPy),
step_time (0.01 s per micro-batch), eval (1: define Task.evaluate), dataset_size (2048).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from elastictrain import Task, eval_shard
from elastictrain.task import option
from elastictrain.toy import synthetic_dataset


class EMA:
    """An exponential moving average of a model's floating-point state (DCP's Stateful shape)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay, self.updates = decay, 0
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def update(self, model: nn.Module) -> None:
        self.updates += 1
        with torch.no_grad():
            for k, v in model.state_dict().items():
                self.shadow[k].mul_(self.decay).add_(v.detach(), alpha=1 - self.decay)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        self.decay, self.updates = state["decay"], state["updates"]
        for k, v in state["shadow"].items():
            self.shadow[k].copy_(v)


def make_task(options: Mapping[str, str]) -> Task:
    dropout = option(options, "dropout", 0.2, float)
    decay = option(options, "ema", 0.9, float)
    noise = option(options, "noise", 1)
    step_time = option(options, "step_time", 0.01, float)
    data = synthetic_dataset(option(options, "dataset_size", 2048))
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 5))
    ema = EMA(model, decay) if decay > 0 else None
    mse = nn.MSELoss()

    def loss_fn(m: nn.Module, batch):
        x, y = batch
        time.sleep(step_time)
        if noise:
            # Draws from both global generators the runner seeds per step.
            x = (
                x
                + random.gauss(0, 0.01)
                + torch.from_numpy(np.random.normal(0, 0.01, x.shape)).float()
            )
        out = m(x)
        return mse(out, y), {"mae": (out - y).abs().mean()}

    def evaluate(m: nn.Module) -> dict:
        idx = list(eval_shard(256))
        x, y = data.tensors[0][idx], data.tensors[1][idx]
        return {"mse": float(mse(m(x), y))}

    return Task(
        model=model,
        dataset=data,
        batch_size=64,
        make_optimizer=lambda p: torch.optim.AdamW(p, lr=0.01),
        loss_fn=loss_fn,
        state={"ema": ema} if ema else {},
        after_step=(lambda done, m: ema.update(m)) if ema else None,
        shard=lambda m, mesh: shard(m, mesh, ema),
        evaluate=evaluate if option(options, "eval", 1) else None,
    )


def shard(model: nn.Module, mesh, ema: EMA | None) -> None:
    """``Task.shard``: FSDP2 per layer with parameters, then the root; the EMA is re-made from the
    sharded weights (same values), so it is sharded like them and checkpointed per rank."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if ema is not None:
        ema.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}


class FaultyDataset(torch.utils.data.Dataset):
    """``dataset`` whose loader workers crash (``os._exit``) or hang once each has served
    ``after`` samples; in the training process it never fails."""

    def __init__(self, dataset, fault: str, after: int) -> None:
        self.dataset, self.fault, self.after, self.served = dataset, fault, after, 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        if torch.utils.data.get_worker_info() is not None:
            self.served += 1
            if self.served > self.after and self.fault == "crash":
                os._exit(9)
            while self.served > self.after and self.fault == "hang":
                time.sleep(1)
        return self.dataset[i]


def make_faulty_loader_task(options: Mapping[str, str]) -> Task:
    """The toy task with a FaultyDataset (options: fault=crash|hang, after=320); fault=bug
    instead raises from the loss at its third call, with an exit hook that would never return
    (as joining a loader worker stuck in I/O, which ignores SIGTERM, never does)."""
    from elastictrain.toy import make_task as toy

    task = toy({})
    if options.get("fault") == "bug":
        import atexit

        atexit.register(time.sleep, 3600)
        calls, loss_fn = [0], task.loss_fn

        def buggy(model, batch):
            calls[0] += 1
            if calls[0] == 3:
                raise ValueError("a bug in the loss")
            return loss_fn(model, batch)

        task.loss_fn = buggy
        return task
    task.dataset = FaultyDataset(
        task.dataset, options.get("fault", "crash"), option(options, "after", 320)
    )
    return task

"""A task every layout can train, for comparing them: a small residual MLP (8 -> 16, two blocks of
16 -> 64 -> 16, -> 1) under AdamW at 3e-3, MSE on a fixed synthetic set, global batch 32, as a
user writes one with ``docs/layouts.md``'s tensor-parallel recipe: each block's ``up``
column-wise and ``down`` row-wise over ``mesh["tp"]``, the input and output layers replicated
over it, ``fully_shard`` over the data-parallel rest.

It covers what the toy does not: Adam, whose step count and moments make any extra or missing
optimizer step show; parameters inside a tensor-parallel group and parameters replicated over it
in one model; a residual stream that carries both.

The activation is GELU: a ReLU lets a last-bit difference decide which side of its kink a
pre-activation lands on, for one sample, and Adam carries that unit's different gradient on (one
unit of 64 ended 8e-5 apart at tp=2, every other weight within 1.5e-7), which is the float sums'
order, not the layout. ``activation=relu`` gives the ReLU.

Options: ``loss_log=DIR`` (each rank's loss per step, ``tp_task.read_losses``); ``kill_at=STEP``
with ``kill_rank=R`` (default 1) and ``kill_marker=PATH``: rank R SIGKILLs itself after
completing step STEP, once (the marker file says it has), as a worker lost mid-run.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastictrain.cluster.env import read_env
from elastictrain.task import Task, option
from tests.helpers.tp_task import log_losses

DATASET_SIZE = 512
BATCH_SIZE = 32


ACTIVATIONS = {"gelu": nn.functional.gelu, "relu": torch.relu}


class Block(nn.Module):
    def __init__(self, activation: str) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)
        self.activation = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.activation(self.up(x)))


class ResidualMLP(nn.Module):
    def __init__(self, activation: str = "gelu") -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block(activation) for _ in range(2))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def shard(model: ResidualMLP, mesh) -> None:
    """docs/layouts.md's recipe."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from elastictrain.mesh import data_mesh

    if "tp" in (mesh.mesh_dim_names or ()):
        for block in model.blocks:
            parallelize_module(
                block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()}
            )
    for block in model.blocks:
        fully_shard(block, mesh=data_mesh(mesh))
    fully_shard(model, mesh=data_mesh(mesh))


def make_task(options: Mapping[str, str]) -> Task:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(DATASET_SIZE, 8, generator=g)
    y = x.sum(1, keepdim=True).sin() + 0.1 * torch.randn(DATASET_SIZE, 1, generator=g)
    torch.manual_seed(0)
    task = Task(
        model=ResidualMLP(options.get("activation", "gelu")),
        dataset=TensorDataset(x, y),
        batch_size=BATCH_SIZE,
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        loss_fn=lambda model, batch: nn.functional.mse_loss(model(batch[0]), batch[1]),
        shard=shard,
    )
    kill_at = option(options, "kill_at", -1)
    if kill_at >= 0:
        task.after_step = _killer(kill_at, option(options, "kill_rank", 1), options["kill_marker"])
    folder = options.get("loss_log")
    return task if folder is None else log_losses(task, folder)


def _killer(step: int, rank: int, marker: str):
    me = read_env().rank

    def after_step(done: int, model: nn.Module) -> None:
        if done == step and me == rank and not os.path.exists(marker):
            open(marker, "w").close()  # noqa: SIM115 - a marker, empty
            os.kill(os.getpid(), signal.SIGKILL)

    return after_step


def train_one_rank(
    steps: int,
    skip: range = range(0),
    seed: int = 0,
    options: Mapping[str, str] | None = None,
    make: Callable[[Mapping[str, str]], Task] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[int, float], dict[int, list[int]]]:
    """The unsharded model trained ``steps`` steps by one process, in a plain loop over the
    runner's global batches, the steps in ``skip`` drawn and not trained (``--skip-steps``):
    (its final weights, each trained step's loss by completed steps, each step's samples), for
    the layouts to agree with. ``make``: another task factory (default this module's), given
    ``options``."""
    from elastictrain.train.data import GlobalBatchSampler

    torch.manual_seed(seed)  # as the runner does before it builds a task
    task = (make or make_task)(dict(options or {}))
    model, dataset = task.model, task.dataset
    optimizer = task.make_optimizer(model.parameters())
    scheduler = task.make_scheduler(optimizer) if task.make_scheduler else None
    sampler = GlobalBatchSampler(len(dataset), task.batch_size, seed)
    losses, batches = {}, {}
    for step in range(steps):
        indices = batches[step] = sampler.global_batch(step).tolist()
        if step in skip:
            continue
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss_fn(model, task.collate_fn([dataset[i] for i in indices]))
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses[step + 1] = float(loss.detach())
    return model.state_dict(), losses, batches

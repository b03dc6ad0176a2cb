"""The built-in toy task: the DDP tutorial's ToyModel on a deterministic synthetic dataset.

Options (``--task-option KEY=VALUE``): hidden (10), layers (1 hidden layer), dataset_size (4096),
batch_size (64, global), lr (0.01), momentum (0.9), step_time (0 s of simulated compute per step),
and for skew tests: slow_rank (none), slow_factor (1: that rank's step_time multiplier),
slow_from_step (0: slow_factor and step_factor apply from this process's N-th micro-step on, as
on a node that starts to throttle mid-run), start_delay (0 s that rank sleeps before initialising), build_delay (0 s every rank of this
command line sleeps before initialising: a node slow to start, given to one node), step_factor
(1: every rank of this command line's step_time multiplier: a slow node), wedge_step (none: in the first attempt,
that rank stops inside this micro-step for good, its process alive, as a rank wedged in a kernel or
a collective is) and first_step_time (0 s more in every rank's first micro-step: a compilation).
frozen_mb (0) adds that many MB of frozen weights: a checkpoint that size, whose persist a test
can aim a kill at, without the compute (or the all-reduce) of a model that size at every step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastictrain.cluster.env import read_env
from elastictrain.errors import ConfigError
from elastictrain.task import Task, option

KNOWN_OPTIONS = {
    "hidden",
    "layers",
    "dataset_size",
    "batch_size",
    "lr",
    "momentum",
    "step_time",
    "slow_rank",
    "slow_factor",
    "slow_from_step",
    "start_delay",
    "build_delay",
    "step_factor",
    "wedge_step",
    "first_step_time",
    "frozen_mb",
}


class Frozen(nn.Module):
    """Weights a checkpoint carries and no step touches (``frozen_mb``): no gradient, and, being
    a module whose forward never runs, never gathered under FSDP either."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nbytes // 4), requires_grad=False)


class ToyModel(nn.Module):
    """Linear(10, hidden) -> ReLU -> [Linear(hidden, hidden) -> ReLU]* -> Linear(hidden, 5)."""

    def __init__(self, hidden: int = 10, layers: int = 1, frozen_mb: float = 0.0) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, hidden)
        self.relu = nn.ReLU()
        self.extra = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers - 1))
        self.net2 = nn.Linear(hidden, 5)
        if frozen_mb > 0:
            self.frozen = Frozen(int(frozen_mb * (1 << 20)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.net1(x))
        for layer in self.extra:
            x = self.relu(layer(x))
        return self.net2(x)


def tensor_parallel(model: ToyModel, tp_mesh) -> None:
    """Megatron's MLP plan over the Linear layers in order: column-wise, then row-wise (its input
    is the column-wise layer's shard, its output summed over the group), and so on; an odd last
    layer is column-wise with its output gathered. Every rank of the group must see the same
    input: the runner gives the group one data-parallel share."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    names = ["net1", *(f"extra.{i}" for i in range(len(model.extra))), "net2"]
    plan = {}
    for i, name in enumerate(names):
        if i % 2:
            plan[name] = RowwiseParallel()
        else:
            last = i == len(names) - 1
            plan[name] = ColwiseParallel(output_layouts=Replicate()) if last else ColwiseParallel()
    parallelize_module(model, tp_mesh, plan)


def shard(model: nn.Module, mesh) -> None:
    """``Task.shard`` for ``--parallel fsdp|hsdp``: the tensor-parallel plan over ``mesh["tp"]``
    when the mesh has one, then the runner's default FSDP units over the data-parallel mesh."""
    from torch.distributed.fsdp import fully_shard

    from elastictrain.mesh import data_mesh
    from elastictrain.train.parallel import default_units

    if "tp" in (mesh.mesh_dim_names or ()):
        tensor_parallel(model, mesh["tp"])
    for group in default_units(model):
        fully_shard(group if len(group) > 1 else group[0], mesh=data_mesh(mesh))
    fully_shard(model, mesh=data_mesh(mesh))


def synthetic_dataset(size: int, seed: int = 1234) -> TensorDataset:
    """Inputs and targets of a fixed random linear map plus noise: learnable, identical everywhere."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 10, generator=g)
    w = torch.randn(10, 5, generator=g)
    y = x @ w + 0.1 * torch.randn(size, 5, generator=g)
    return TensorDataset(x, y)


def make_task(options: Mapping[str, str]) -> Task:
    unknown = set(options) - KNOWN_OPTIONS
    if unknown:
        raise ConfigError(
            f"Unknown toy --task-option {sorted(unknown)}; known: {sorted(KNOWN_OPTIONS)}."
        )
    hidden = option(options, "hidden", 10)
    layers = option(options, "layers", 1)
    if hidden < 1 or layers < 1:
        raise ConfigError(
            f"Toy task needs hidden >= 1 and layers >= 1, got hidden={hidden}, layers={layers}."
        )
    step_time = option(options, "step_time", 0.0, float)
    slow_rank = option(options, "slow_rank", -1)
    env = read_env()
    wedge_at = option(options, "wedge_step", -1)
    wedges = env.rank == slow_rank and env.restart_count == 0 and wedge_at >= 0
    calls = [0]
    first_step_time = option(options, "first_step_time", 0.0, float)
    healthy_step_time = step_time
    if env.rank == slow_rank:
        step_time *= option(options, "slow_factor", 1.0, float)
        time.sleep(option(options, "start_delay", 0.0, float))  # the task is built before init
    slow_from = option(options, "slow_from_step", 0)
    time.sleep(option(options, "build_delay", 0.0, float))
    step_time *= option(options, "step_factor", 1.0, float)
    lr = option(options, "lr", 0.01, float)
    momentum = option(options, "momentum", 0.9, float)
    mse = nn.MSELoss()

    def loss_fn(model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        if step_time > 0:  # simulated compute, so tests can kill mid-run
            time.sleep(step_time if calls[0] >= slow_from else healthy_step_time)
        if calls[0] == 0:
            time.sleep(first_step_time)  # holds the GIL no more than a compiler's Python does
        calls[0] += 1
        while wedges and calls[0] > wedge_at:
            time.sleep(3600)  # the GIL is free: this rank's heartbeat goes on
        return mse(model(x), y)

    return Task(
        model=ToyModel(hidden, layers, option(options, "frozen_mb", 0.0, float)),
        dataset=synthetic_dataset(option(options, "dataset_size", 4096)),
        batch_size=option(options, "batch_size", 64),
        make_optimizer=lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum),
        make_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=200, gamma=0.5),
        loss_fn=loss_fn,
        shard=shard,
    )

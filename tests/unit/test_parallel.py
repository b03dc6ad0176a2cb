"""elastictrain.train.parallel: a model laid out in a way the runner was not told about is refused before
anything is written; FSDP and HSDP are not. (One process: every mesh dimension has size 1, and the
placements are what they would be at any size.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastictrain.errors import ConfigError, exit_code
from elastictrain.mesh import MeshShape
from elastictrain.train import parallel


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _tensor_parallel(model: nn.Module, mesh) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def test_tensor_parallelism_over_the_runners_mesh_is_refused_with_exit_2(one_rank):
    """The issue's case: Task.shard applies tensor parallelism over the mesh it is given; the
    runner would feed both ranks of the pair different samples."""
    model = _model()
    with pytest.raises(ConfigError, match=r"'0\.weight'.*no fully_shard manages it") as caught:
        parallel.shard(model, _tensor_parallel, torch.device("cpu"), 1)
    assert exit_code(caught.value) == 2
    assert "tensor (or another model) parallelism" in str(caught.value)
    assert "--mesh tp=N" in str(caught.value)  # the fix: declare it


def test_a_tensor_parallel_mesh_without_a_task_shard_is_refused_before_any_mesh_is_built():
    with pytest.raises(ConfigError, match=r"--mesh tp=2 needs a Task.shard") as caught:
        parallel.shard(_model(), None, torch.device("cpu"), MeshShape(dp_shard=2, tp=2))
    assert exit_code(caught.value) == 2


def test_tensor_parallelism_under_fsdp_on_a_2d_mesh_is_refused(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def shard(model, mesh):
        mesh2d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        _tensor_parallel(model, mesh2d["tp"])
        fully_shard(model, mesh=mesh2d["dp"])

    with pytest.raises(ConfigError, match="it is sharded twice"):
        parallel.shard(_model(), shard, torch.device("cpu"), 1)


def test_a_ddp_model_with_tensor_parallel_parameters_is_refused(one_rank):
    from torch.distributed.device_mesh import init_device_mesh

    model = _model()
    _tensor_parallel(model, init_device_mesh("cpu", (1,)))
    with pytest.raises(ConfigError, match="no fully_shard manages it"):
        parallel.for_setting("ddp").place(model, None, torch.device("cpu"), 1)
    parallel.for_setting("ddp").place(_model(), None, torch.device("cpu"), 1)  # plain: fine


def test_fsdp_by_default_by_the_task_and_hsdp_over_a_2d_mesh_are_accepted(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    parallel.shard(_model(), None, torch.device("cpu"), 1)
    parallel.shard(_model(), lambda m, mesh: fully_shard(m, mesh=mesh), torch.device("cpu"), 1)

    def hsdp(model, mesh):
        mesh2d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh2d)

    parallel.shard(_model(), hsdp, torch.device("cpu"), 1)

"""The toy task sharded as HSDP by the task itself, as a user would write it today: a 2-D mesh of
(replicate, shard) with ``replicas`` replicas (``--task-option replicas=R``), ``fully_shard`` over
it. Every other option is the toy's."""

from __future__ import annotations

from collections.abc import Mapping

from elastictrain import toy
from elastictrain.cluster.env import read_env
from elastictrain.task import Task
from elastictrain.train import parallel


def make_task(options: Mapping[str, str]) -> Task:
    replicas = int(options.get("replicas", 2))
    task = toy.make_task({k: v for k, v in options.items() if k != "replicas"})

    def shard(model, mesh) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = read_env().world_size
        mesh2d = init_device_mesh(
            mesh.device_type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
        )
        for group in parallel.default_units(model):  # the runner's own units, on the 2-D mesh
            fully_shard(group if len(group) > 1 else group[0], mesh=mesh2d)
        fully_shard(model, mesh=mesh2d)

    task.shard = shard
    return task

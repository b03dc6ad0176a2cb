"""``--parallel``: how the model is spread over the ranks, and the few places that differs.

- ddp: every rank holds the whole model; ``DistributedDataParallel`` all-reduces gradients.
- fsdp: FSDP2's ``fully_shard`` on a 1-D mesh over all ranks: parameters, gradients and optimizer
  state are sharded, so no rank ever holds the whole state. Applied before the optimizer is built,
  which then steps the local shards. Checkpoints follow from the DTensor parameters
  (``checkpoint.sharded``): every rank writes its own shards.

Both average gradients over the ranks, so the runner's loss weighting (the global-batch mean at any
world size) is the same for both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

MODES = ("ddp", "fsdp")


def shard(model: nn.Module, task_shard: Any, device: torch.device, world_size: int) -> None:
    """Apply FSDP2 in place: the task's ``shard(model, mesh)``, else each child module that has
    parameters (through ModuleLists), then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    if task_shard is not None:
        task_shard(model, mesh)
        return
    for unit in _units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _units(model: nn.Module) -> Iterator[nn.Module]:
    """The default FSDP units: each child module with parameters; a container without a forward
    of its own (ModuleList, ModuleDict) stands for its children."""
    for child in model.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            yield from _units(child)
        elif any(True for _ in child.parameters()):
            yield child


def wrap_ddp(model: nn.Module, device: torch.device, model_devices: Any) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    # device_ids=None for a CPU model and for a module that spans devices (the tutorial's MP-DDP).
    single_gpu = device.type == "cuda" and not model_devices
    return DDP(model, device_ids=[device.index] if single_gpu else None)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally for a micro-batch that is not the step's last: DDP skips its
    all-reduce, FSDP2 its reduce-scatter."""
    if hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def full(value: torch.Tensor) -> torch.Tensor:
    """A sharded scalar (FSDP2's gradient norm is a DTensor) as a plain tensor."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value

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

from elastictrain.errors import ConfigError

MODES = ("ddp", "fsdp")


class Replicate:
    """``--parallel ddp``: the whole model on every rank, wrapped after the resume loaded it."""

    name = "ddp"
    primes_buckets = True
    """DDP's gradient buckets are built at the first backward: prime them before the loop."""

    def place(self, model: nn.Module, task_shard: Any, device: torch.device, world: int) -> None:
        """Before the optimizer is built: refuse a model whose task made its parameters DTensors
        (tensor parallelism, which DDP's data split would feed wrongly). Plain parameters are told
        apart by their type alone, so a DDP restart imports nothing for it."""
        if any(type(p) is not nn.Parameter for p in model.parameters()):
            refuse_model_parallelism(model)

    def wrap(self, model: nn.Module, device: torch.device, model_devices: Any) -> nn.Module:
        return wrap_ddp(model, device, model_devices)


class Shard:
    """``--parallel fsdp``: FSDP2 applied in place before the optimizer, which steps the shards."""

    name = "fsdp"
    primes_buckets = False

    def place(self, model: nn.Module, task_shard: Any, device: torch.device, world: int) -> None:
        shard(model, task_shard, device, world)

    def wrap(self, model: nn.Module, device: torch.device, model_devices: Any) -> nn.Module:
        return model  # sharded in place by ``place``


def for_setting(parallel: str) -> Replicate | Shard:
    """The one place the runner reads ``--parallel``."""
    return {"ddp": Replicate, "fsdp": Shard}[parallel]()


def shard(model: nn.Module, task_shard: Any, device: torch.device, world_size: int) -> None:
    """Apply FSDP2 in place: the task's ``shard(model, mesh)``, else the default units (see
    :func:`default_units`), then the root.

    Raises:
        ConfigError: the task's ``shard`` put two modules that share a parameter (tied weights) in
            different FSDP groups, which FSDP2 would only refuse at the first forward; or it laid
            the model out in a way the runner cannot feed (:func:`refuse_model_parallelism`).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    if task_shard is not None:
        tied = shared_parameters(model)
        task_shard(model, mesh)
        check_ties_grouped(model, tied)
    else:
        for group in default_units(model):
            fully_shard(group if len(group) > 1 else group[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    refuse_model_parallelism(model)


def refuse_model_parallelism(model: nn.Module) -> None:
    """After ``Task.shard``: every DTensor parameter must be FSDP's, sharded along one mesh
    dimension at most (HSDP replicates along the other). Anything else is tensor (or another
    model) parallelism, which the runner was not told about: it gives every rank its own samples,
    so the ranks of one tensor-parallel group would compute one layer on different samples and
    their collectives would add them up, training silently on the wrong data.

    Raises:
        ConfigError: naming the first such parameter; before anything is written.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    managed = {id(p) for m in model.modules() if isinstance(m, FSDPModule) for p in m.parameters()}
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            continue
        shards = sum(1 for placement in param.placements if placement.is_shard())
        if id(param) in managed and shards <= 1:
            continue
        why = "no fully_shard manages it" if id(param) not in managed else "it is sharded twice"
        raise ConfigError(
            f"Task.shard made parameter {name!r} a DTensor with placements "
            f"{tuple(param.placements)}, and {why}: that is tensor (or another model) "
            "parallelism, and the runner splits the data over every rank, so it would train on "
            "the wrong samples. The runner does not support tensor parallelism yet; shard with "
            "fully_shard only (FSDP over the mesh it gives, or HSDP over a 2-D mesh of your own)."
        )


def shared_parameters(model: nn.Module) -> dict[int, list[str]]:
    """Tied weights: for each parameter (by ``id``) reached from more than one module, the names
    of those modules (``""`` for the root), found by identity before anything is sharded."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module._parameters.values():
            if param is not None and name not in owners.setdefault(id(param), []):
                owners[id(param)].append(name)
    return {pid: names for pid, names in owners.items() if len(names) > 1}


def default_units(model: nn.Module) -> list[list[nn.Module]]:
    """The default FSDP units, each a list of modules sharded as one group: each child module with
    parameters; a container without a forward of its own (ModuleList, ModuleDict) stands for its
    children. A module holding one end of a tied weight is walked into, so the tie is found at
    its smallest modules (GPT-2's ``wte`` and ``lm_head``, not ``transformer``), and the modules
    that share a parameter are grouped: FSDP2 requires one group to manage a shared parameter."""
    units = list(_units(model, set(shared_parameters(model))))
    # Union the units whose parameters overlap (by identity), keeping first-seen order.
    groups: list[tuple[list[nn.Module], set[int]]] = []
    for unit in units:
        ids = {id(p) for p in unit.parameters()}
        merged = [g for g in groups if g[1] & ids]
        members = [m for g in merged for m in g[0]] + [unit]
        for g in merged:
            groups.remove(g)
        groups.append((members, ids.union(*(g[1] for g in merged))))
    return [members for members, _ in groups]


def _units(model: nn.Module, tied_ids: set[int]) -> Iterator[nn.Module]:
    for child in model.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            yield from _units(child, tied_ids)
        elif any(id(p) in tied_ids for p in child.parameters()) and any(
            True for _ in child.children()
        ):
            # Its own direct parameters (if any) fall to the enclosing group: the root's.
            yield from _units(child, tied_ids)
        elif any(True for _ in child.parameters()):
            yield child


def check_ties_grouped(model: nn.Module, tied: dict[int, list[str]]) -> None:
    """Every tied parameter's modules must share one FSDP group: the nearest ``fully_shard``ed
    module at or above each must have the same FSDP state."""
    from torch.distributed.fsdp import FSDPModule

    def group_of(name: str) -> Any:
        parts = name.split(".") if name else []
        for depth in range(len(parts), -1, -1):
            module = model.get_submodule(".".join(parts[:depth]))
            if isinstance(module, FSDPModule):
                return module._get_fsdp_state()
        return None

    for names in tied.values():
        groups = [group_of(n) for n in names]
        if any(g is not groups[0] for g in groups[1:]):
            shown = " and ".join(repr(n or "<root>") for n in names)
            together = ", ".join(f"model.get_submodule({n!r})" for n in names if n)
            raise ConfigError(
                f"Task.shard put modules {shown}, which share a parameter (tied weights), in "
                "different FSDP groups; FSDP2 would fail at the first forward. Shard them as one "
                f"group, fully_shard([{together}], mesh=mesh), or leave them all to the root's "
                "fully_shard(model)."
            )


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

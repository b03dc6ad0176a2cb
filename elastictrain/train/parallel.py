"""``--parallel``: how the model is spread over the ranks, and the few places that differs.

- ddp: every rank holds the whole model; ``DistributedDataParallel`` all-reduces gradients.
- fsdp, hsdp: FSDP2's ``fully_shard`` over the runner's named mesh (:mod:`elastictrain.mesh`): 1-D
  over all ranks by default, (dp_replicate, dp_shard) for HSDP, with ``tp`` when the task applies
  tensor parallelism. Parameters, gradients and optimizer state are sharded, so no rank ever holds
  the whole state. Applied before the optimizer is built, which then steps the local shards.
  Checkpoints follow from the DTensor parameters (``checkpoint.sharded``): every rank writes its
  own shards, a replicated one once.

All average gradients over the data-parallel ranks, so the runner's loss weighting (the
global-batch mean at any world size) is the same for all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastictrain.errors import ConfigError
from elastictrain.mesh import MeshShape, data_mesh


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
            refuse_model_parallelism(model, None)

    def wrap(
        self, model: nn.Module, device: torch.device, model_devices: Any, synced: bool = False
    ) -> nn.Module:
        return wrap_ddp(model, device, model_devices, synced)


class Shard:
    """``--parallel fsdp|hsdp``: FSDP2 applied in place before the optimizer, which steps the
    shards; over the runner's named mesh (``shape``), else one dimension of every rank."""

    name = "fsdp"
    primes_buckets = False

    def __init__(self, shape: MeshShape | None = None) -> None:
        self.shape = shape

    def place(self, model: nn.Module, task_shard: Any, device: torch.device, world: int) -> None:
        shard(model, task_shard, device, self.shape or MeshShape(dp_shard=world))

    def wrap(
        self, model: nn.Module, device: torch.device, model_devices: Any, synced: bool = False
    ) -> nn.Module:
        return model  # sharded in place by ``place``


def for_setting(parallel: str, shape: MeshShape | None = None) -> Replicate | Shard:
    """The one place the runner reads ``--parallel`` (``shape``: its resolved ``--mesh``)."""
    return Replicate() if parallel == "ddp" else Shard(shape)


def shard(model: nn.Module, task_shard: Any, device: torch.device, shape: MeshShape | int) -> None:
    """Apply FSDP2 in place over ``shape``'s mesh (an int W: FSDP over W ranks): the task's
    ``shard(model, mesh)``, else the default units (see :func:`default_units`), then the root,
    over the data-parallel dimensions.

    Raises:
        ConfigError: the task's ``shard`` put two modules that share a parameter (tied weights) in
            different FSDP groups, which FSDP2 would only refuse at the first forward; it laid
            the model out in a way the runner cannot feed (:func:`refuse_model_parallelism`); or
            the mesh has ``tp`` and there is no ``Task.shard`` to apply a tensor-parallel plan.
    """
    from torch.distributed.fsdp import fully_shard

    if isinstance(shape, int):
        shape = MeshShape(dp_shard=shape)
    if task_shard is None and shape.tp > 1:
        raise ConfigError(
            f"--mesh tp={shape.tp} needs a Task.shard(model, mesh) that applies the model's "
            "tensor-parallel plan over mesh['tp'] (parallelize_module), then fully_shard over "
            "elastictrain.mesh.data_mesh(mesh); the runner cannot guess the plan. Or drop tp."
        )
    mesh = shape.build(device.type)
    if task_shard is not None:
        tied = shared_parameters(model)
        task_shard(model, mesh)
        check_ties_grouped(model, tied)
    else:
        for group in default_units(model):
            fully_shard(group if len(group) > 1 else group[0], mesh=data_mesh(mesh))
        fully_shard(model, mesh=data_mesh(mesh))
    refuse_model_parallelism(model, shape)


def refuse_model_parallelism(model: nn.Module, shape: MeshShape | None) -> None:
    """After ``Task.shard``: every DTensor parameter must be laid out as the runner was told.
    Without ``tp`` in the mesh (``shape``), a parameter must be FSDP's, sharded along one mesh
    dimension at most (HSDP replicates along the other). With it, a parameter may also be sharded
    along ``tp``, on a mesh of the runner's dimensions and sizes. Anything else is tensor (or
    another model) parallelism the runner was not told about: it would give the ranks of one
    tensor-parallel group different samples, and their collectives would add them up, training
    silently on the wrong data.

    Raises:
        ConfigError: naming the first such parameter; before anything is written.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    managed = {id(p) for m in model.modules() if isinstance(m, FSDPModule) for p in m.parameters()}
    tp = shape is not None and shape.tp > 1
    world = dist.get_world_size() if dist.is_initialized() else 1
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            continue
        why = _unfed(param, id(param) in managed, shape if tp else None, world)
        if why is None:
            continue
        fix = (
            "apply the tensor-parallel plan over mesh['tp'] of the mesh Task.shard is given, "
            "and fully_shard over elastictrain.mesh.data_mesh(mesh)"
            if tp
            else "declare it with --parallel fsdp --mesh tp=N (every rank of a tensor-parallel "
            "group then trains on the same samples) and apply the plan over mesh['tp']; or "
            "shard with fully_shard only"
        )
        raise ConfigError(
            f"Task.shard made parameter {name!r} a DTensor with placements "
            f"{tuple(param.placements)}, and {why}: that is tensor (or another model) "
            "parallelism the runner was not told about, so it would train on the wrong samples. "
            f"To fix: {fix}."
        )


def _unfed(param: Any, managed: bool, shape: MeshShape | None, world: int) -> str | None:
    """Why the runner would feed ``param``'s layout wrong samples; None when it would not."""
    sharded = [d for d, p in enumerate(param.placements) if p.is_shard() or p.is_partial()]
    if shape is None:  # no tensor parallelism declared: FSDP or HSDP only
        if param.device_mesh.size() != world:  # pipeline stages, or a group of the ranks
            return f"its mesh spans {param.device_mesh.size()} of the {world} ranks"
        if not managed:
            return "no fully_shard manages it"
        return "it is sharded twice" if len(sharded) > 1 else None
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or ()
    for d, name in enumerate(names):
        if name not in shape.present() or mesh.size(d) != getattr(shape, name):
            return f"its mesh dimension {name!r} of size {mesh.size(d)} is not the runner's"
    if len(names) != mesh.ndim:
        return "its mesh is not the runner's (its dimensions have no names)"
    for d in sharded:
        if names[d] not in ("tp", "dp_shard") or (names[d] == "dp_shard" and not managed):
            return f"it is sharded along {names[d]!r}"
    return None


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


def wrap_ddp(
    model: nn.Module,
    device: torch.device,
    model_devices: Any,
    synced: bool = False,
    group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """``synced``: every rank holds the same parameters and buffers already (an in-place epoch:
    each loaded the same verified bytes from a survivor), so DDP's broadcast of them from rank 0
    is skipped: the state's size once more over the network, in the survivors' stall."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    # device_ids=None for a CPU model and for a module that spans devices (the tutorial's MP-DDP).
    single_gpu = device.type == "cuda" and not model_devices
    return DDP(
        model,
        device_ids=[device.index] if single_gpu else None,
        init_sync=not synced,
        process_group=group,
    )


class KeptReplica:
    """``--parallel ddp`` in place: the process's DDP wrapper, kept across its membership epochs.

    Each in-place epoch moves the wrapper to its new group (DDP's own ``_update_process_group``,
    made for a world that changes) instead of wrapping anew. Its gradient buckets keep the order
    DDP gave them after the process's first backward, and that order is gloo's summation order
    past two ranks: an uninterrupted run's. So the epoch needs no priming backward, which cost
    every rank a forward, a backward and an all-reduce of the whole gradient, and no new
    wrapper's collectives, in the survivors' stall. A process that holds no primed wrapper (the
    replacement) primes a new one alone, on a group of itself with no peer to wait for, then
    moves it to the epoch's group: the same model and backward give it the survivors' buckets.
    """

    def __init__(self) -> None:
        self.net: nn.Module | None = None
        self.primed = False
        """Its buckets are in their rebuilt order: its first backward ran, and the rebuild."""
        self._alone: dist.ProcessGroup | None = None

    def wrap(self, model: nn.Module, device: torch.device, model_devices: Any) -> nn.Module:
        """An in-place epoch's wrapper: the kept one, on the epoch's group; else a new one on a
        group of this process alone, which :meth:`prime_alone` primes and moves (``alone``)."""
        if self.primed and self.net is not None and self.net.module is model:
            self.net._update_process_group(dist.group.WORLD)
            return self.net
        rank = dist.get_rank()
        # Hashed, local: only this process builds it, and no other group's name moves.
        self._alone = dist.new_group([rank], use_local_synchronization=True)
        self.net = wrap_ddp(model, device, model_devices, synced=True, group=self._alone)
        self.primed = False
        return self.net

    @property
    def alone(self) -> bool:
        return self._alone is not None

    def prime_alone(self, backward: Callable[[nn.Module], None] | None) -> None:
        """Run ``backward`` (one discarded step's forward and backward) on the new wrapper alone,
        order its buckets as DDP would at its next forward, then move it to the epoch's group.
        None: no step is left to train; the wrapper only moves."""
        net, alone = self.net, self._alone
        assert net is not None and alone is not None, "prime_alone after a new wrapper only"
        if backward is not None:
            backward(net)
            # What DDP's next forward does first (torch's Join hook calls it the same way).
            self.primed = net.reducer._rebuild_buckets()
        net._update_process_group(dist.group.WORLD)
        dist.destroy_process_group(alone)
        self._alone = None

    def prime_as_spare(
        self,
        model: nn.Module,
        device: torch.device,
        backward: Callable[[nn.Module], None],
    ) -> None:
        """A spare (CPU), before it is called: a wrapper primed now, on a default group of this
        process alone (an in-memory store), destroyed before the spare joins an epoch. Its first
        epoch then only moves it (:meth:`wrap`): the replacement's priming backward leaves the
        survivors' stall as well. (Not on CUDA: a group of one per spare is NCCL's to set up.)"""
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            net = wrap_ddp(model, device, None, synced=True)
            backward(net)
            self.primed = net.reducer._rebuild_buckets()
            self.net = net
        finally:
            dist.destroy_process_group()

    def kept(self, net: nn.Module) -> None:
        """``net``, wrapped and primed with every rank (a first epoch), is the one to keep."""
        self.net, self.primed = net, True


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

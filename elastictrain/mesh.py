"""``--mesh``: the named device mesh the runner builds for ``--parallel fsdp|hsdp``, and each rank's
data-parallel coordinates (which samples it trains on).

The dimensions are torchtitan's ``ParallelDims`` names, outermost first:

- ``dp_replicate``: whole replicas of the model (HSDP's replicas, usually one per node or island);
- ``dp_shard``: FSDP within a replica (its parameters, gradients and optimizer state sharded);
- ``tp``: tensor parallelism, innermost, so a tensor-parallel group is ``tp`` consecutive ranks
  (on one node, where its per-layer collectives belong).

Global rank ``r`` sits at ``(r // (S*T), r // T % S, r % T)``. Its data-parallel rank is ``r // T``
of ``R*S``: every rank of one tensor-parallel group trains on the same samples, and the loss
weighting, the seeds, the exactly-once ledger and a stream's split all count data-parallel ranks.
Without a mesh (``--parallel ddp``, or ``fsdp`` without ``--mesh``) every rank is its own
data-parallel rank, exactly as before.

``Task.shard(model, mesh)`` receives the mesh with the dimensions that are there: ``dp_shard``
always, ``dp_replicate`` when there are replicas, ``tp`` when there is tensor parallelism. So an
FSDP task's ``fully_shard(unit, mesh=mesh)`` is HSDP as it stands under ``--parallel hsdp``; a
tensor-parallel task applies its plan over ``mesh["tp"]`` and shards over :func:`data_mesh`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastictrain.errors import ConfigError

DIMS = ("dp_replicate", "dp_shard", "tp")
NOT_YET = {
    "pp": "pipeline parallelism",
    "cp": "context parallelism",
    "ep": "expert parallelism",
}
"""torchtitan's other dimensions, refused by name (docs/layouts.md)."""
REST = -1
"""A size of ``-1``: whatever the world size leaves (at most one dimension)."""


def parse(spec: str) -> dict[str, int]:
    """``"dp_replicate=2,tp=4"`` -> ``{"dp_replicate": 2, "tp": 4}``; a bad spec names the fix.

    Raises:
        ConfigError: an unknown name, a size that is not a whole number >= 1 (or -1), a name
            given twice, or more than one -1.
    """
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, eq, value = part.partition("=")
        name = name.strip()
        if name in NOT_YET:
            raise ConfigError(
                f"--mesh {spec!r}: {name} ({NOT_YET[name]}) is not supported yet: the runner "
                "would feed it the wrong data. docs/layouts.md says what it needs; leave it out."
            )
        if not eq or name not in DIMS:
            raise ConfigError(
                f"--mesh {spec!r}: {part!r} is not DIM=N with DIM one of {', '.join(DIMS)} "
                "(e.g. --mesh dp_replicate=2,dp_shard=8,tp=4)."
            )
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1 and size != REST:
            raise ConfigError(
                f"--mesh {spec!r}: {name}={value.strip()!r} must be a whole number >= 1, or -1 for "
                "the rest of the world size."
            )
        if name in sizes:
            raise ConfigError(f"--mesh {spec!r}: {name} is given twice.")
        sizes[name] = size
    if list(sizes.values()).count(REST) > 1:
        raise ConfigError(f"--mesh {spec!r}: at most one dimension may be -1 (the rest).")
    return sizes


@dataclass(frozen=True)
class MeshShape:
    """The sizes of the three dimensions; ``dp_replicate * dp_shard * tp`` is the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def data_parallel(self) -> int:
        return self.dp_replicate * self.dp_shard

    def data(self, rank: int) -> DataRanks:
        """Rank ``rank``'s data-parallel coordinates."""
        return DataRanks(rank // self.tp, self.data_parallel, rank % self.tp == 0)

    def present(self) -> tuple[str, ...]:
        """The dimensions the mesh is built with: ``dp_shard`` always, the others when > 1."""
        return tuple(d for d in DIMS if d == "dp_shard" or getattr(self, d) > 1)

    def describe(self) -> str:
        return ",".join(f"{d}={getattr(self, d)}" for d in DIMS)

    def build(self, device_type: str) -> Any:
        """The ``DeviceMesh`` over every rank, its dimensions named (:meth:`present`)."""
        from torch.distributed.device_mesh import init_device_mesh

        names = self.present()
        shape = tuple(getattr(self, d) for d in names)
        return init_device_mesh(device_type, shape, mesh_dim_names=names)


def resolve(parallel: str, spec: str | None, world: int, local_world: int) -> MeshShape | None:
    """The mesh for this run's ``--parallel`` and ``--mesh`` at this world size; None for DDP.

    Omitted sizes: ``tp`` 1; ``dp_replicate`` 1 under fsdp, the rest (one replica per node) under
    hsdp; ``dp_shard`` the rest under fsdp, the ranks of one node over ``tp`` under hsdp. The rest
    (``-1``) is what makes a mesh elastic: a lost node takes a replica (or a shard) away.

    Raises:
        ConfigError: the sizes do not multiply to the world size, or ``--mesh`` with ``ddp``.
    """
    if parallel == "ddp":
        if spec:
            raise ConfigError(
                f"--mesh {spec!r} needs --parallel fsdp or hsdp: DDP replicates the whole model "
                "on every rank. Add --parallel fsdp (or hsdp), or drop --mesh."
            )
        return None
    sizes = parse(spec or "")
    tp = sizes.setdefault("tp", 1)
    if parallel == "hsdp":
        if tp != REST and local_world % tp:
            raise ConfigError(
                f"--parallel hsdp shards within a node: tp={tp} does not divide its "
                f"{local_world} ranks. Give --mesh dp_shard=N explicitly."
            )
        sizes.setdefault("dp_shard", local_world // tp if tp != REST else 1)
        sizes.setdefault("dp_replicate", REST)
    else:
        sizes.setdefault("dp_replicate", 1)
        sizes.setdefault("dp_shard", REST)
    known = 1
    for d in DIMS:
        known *= sizes[d] if sizes[d] != REST else 1
    rest = [d for d in DIMS if sizes[d] == REST]
    if rest and world % known == 0:
        sizes[rest[0]] = world // known
    shape = MeshShape(**sizes)
    if shape.world != world:
        raise ConfigError(
            f"--parallel {parallel} --mesh {spec or ''!r} gives {shape.describe()}, "
            f"{_product(sizes)} ranks; this run has world size {world}. Make the sizes multiply "
            "to the world size, or leave one out (or -1) to take the rest."
        )
    return shape


def _product(sizes: dict[str, int]) -> str:
    return " x ".join(str(sizes[d]) if sizes[d] != REST else "?" for d in DIMS)


def data_mesh(mesh: Any) -> Any:
    """The data-parallel part of a runner's mesh (no ``tp``): what ``fully_shard`` shards over,
    HSDP when it has ``dp_replicate``."""
    names = tuple(n for n in mesh.mesh_dim_names if n != "tp")
    return mesh[names] if len(names) > 1 else mesh[names[0]]


@dataclass(frozen=True)
class DataRanks:
    """Where a rank sits among the data-parallel ranks: the samples it trains on are share
    ``rank`` of ``size`` of every global batch. ``leader``: the first rank of its tensor-parallel
    group, the one that records the group's samples in the exactly-once ledger."""

    rank: int
    size: int
    leader: bool = True


def data_ranks(shape: MeshShape | None, rank: int, world: int) -> DataRanks:
    """Rank ``rank``'s data-parallel coordinates: by the mesh, else every rank its own."""
    return shape.data(rank) if shape is not None else DataRanks(rank, world)


_current: DataRanks | None = None


def use(data: DataRanks) -> None:
    """Set this process's data-parallel coordinates (the runner, at start), for
    :func:`elastictrain.task.eval_shard`."""
    global _current
    _current = data


def current() -> DataRanks | None:
    return _current

"""The only reader of torchrun's environment variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from elastictrain import knobs
from elastictrain.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    """Where this process sits in the job, as torchrun described it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    """Per node: differs between nodes after membership changes, so never a global key."""
    max_restarts: int
    run_id: str
    use_agent_store: bool
    """True when torchrun shares its rendezvous TCPStore (kept alive across restarts) with workers."""
    launched_by_torchrun: bool
    under_agent: bool = False
    """A torchrun agent is this process's parent (it set TORCHELASTIC_RUN_ID)."""
    agent_pid: int | None = None
    """That agent's pid, read at start, before anything could reparent this process."""
    node_rank: int = 0
    """This process's node: its torchrun agent's rank in the rendezvous (``GROUP_RANK``)."""
    group_world_size: int = 1
    """The agents (nodes) in torchrun's rendezvous round (``GROUP_WORLD_SIZE``)."""

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None:
        if default is None:
            raise ConfigError(f"Environment variable {name} is not set; launch with torchrun.")
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise ConfigError(f"Environment variable {name}={raw!r} is not an integer.") from e


def read_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read torchrun's variables; without them, describe a single-process run."""
    environ = os.environ if environ is None else environ
    launched = "RANK" in environ and "WORLD_SIZE" in environ
    world_size = _int(environ, "WORLD_SIZE", 1)
    rank = _int(environ, "RANK", 0)
    if not 0 <= rank < world_size:
        raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={world_size}.")
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=_int(environ, "LOCAL_RANK", 0),
        local_world_size=_int(environ, "LOCAL_WORLD_SIZE", 1),
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(environ, "MASTER_PORT", 0),
        restart_count=_int(environ, "TORCHELASTIC_RESTART_COUNT", 0),
        max_restarts=_int(environ, "TORCHELASTIC_MAX_RESTARTS", 0),
        run_id=environ.get("TORCHELASTIC_RUN_ID", "local"),
        use_agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        launched_by_torchrun=launched,
        under_agent="TORCHELASTIC_RUN_ID" in environ,
        # Under --replace-in-place the parent is the rank's supervisor, which names the agent.
        agent_pid=knobs.agent_pid(environ) if "TORCHELASTIC_RUN_ID" in environ else None,
        node_rank=_int(environ, "GROUP_RANK", 0),
        group_world_size=_int(environ, "GROUP_WORLD_SIZE", 1),
    )


# torch's c10d rendezvous port when --rdzv-endpoint names none (c10d_rendezvous_backend.DEFAULT_PORT).
_RDZV_DEFAULT_PORT = 29400
_LAUNCHERS = ("torchrun", "torch.distributed.run")


@dataclass(frozen=True)
class StoreAddress:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def min_nodes(env: DistEnv) -> int | None:
    """torchrun's least node count (MIN of ``--nnodes=MIN:MAX``, or N of ``--nnodes=N``) from
    the agent's command line; None where it cannot be read (not under an agent, another
    launcher)."""
    argv = _agent_argv(env)
    starts = [i + 1 for i, a in enumerate(argv or ()) if os.path.basename(a) in _LAUNCHERS]
    if not starts:
        return None
    from torch.distributed.run import get_args_parser, parse_min_max_nnodes

    try:
        args, _ = get_args_parser().parse_known_args(argv[starts[0] :])
        return int(parse_min_max_nnodes(str(args.nnodes))[0])
    except (SystemExit, ValueError, RuntimeError):  # not a command line torchrun would accept
        return None


def _agent_argv(env: DistEnv) -> list[str] | None:
    """The command line of the torchrun agent that started this worker (``/proc``)."""
    if env.agent_pid is None:
        return None
    try:
        with open(f"/proc/{env.agent_pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None


def rendezvous_store(env: DistEnv) -> StoreAddress | None:
    """torchrun's c10d rendezvous store, as the agent that started this worker was told: its
    command line (``/proc/<agent>/cmdline``) and ``PET_*`` environment, read by torchrun's own
    parser.

    Why: the one store every agent must reach to re-form the group is the rendezvous store, while
    ``MASTER_ADDR``/``MASTER_PORT`` can name a node that left (torch 2.13 caches the shared store's
    address per node: docs/faults.md). None where there is no such store or it cannot be named
    for sure: not under a torchrun agent, ``--standalone`` (one node: its address cannot go
    stale), another backend (static, etcd) or a file store, or an agent whose ``--rdzv-id`` is not
    this worker's ``TORCHELASTIC_RUN_ID`` (a wrapper process in between).
    """
    argv = _agent_argv(env)
    return None if argv is None else rendezvous_in_command(argv, env.run_id)


def rendezvous_in_command(argv: list[str], run_id: str) -> StoreAddress | None:
    """The c10d rendezvous store a torchrun command line (``argv``, the interpreter first) and
    this process's ``PET_*`` environment name for the run ``run_id``; see
    :func:`rendezvous_store`."""
    starts = [i + 1 for i, a in enumerate(argv) if os.path.basename(a) in _LAUNCHERS]
    if not starts:
        return None
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    from torch.distributed.run import get_args_parser

    try:
        args, _ = get_args_parser().parse_known_args(argv[starts[0] :])
    except (SystemExit, ValueError):  # not a command line torchrun would have accepted
        return None
    conf = dict(kv.split("=", 1) for kv in (args.rdzv_conf or "").split(",") if "=" in kv)
    if (
        args.standalone
        or args.rdzv_backend != "c10d"
        or conf.get("store_type", "tcp").strip().lower() != "tcp"
        or args.rdzv_id != run_id
    ):
        return None
    host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=_RDZV_DEFAULT_PORT)
    return StoreAddress(host, port) if port else None

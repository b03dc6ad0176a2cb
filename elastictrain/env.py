"""The only reader of torchrun's environment variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

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
    )

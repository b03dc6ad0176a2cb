"""Every ``ELASTICTRAIN_*`` environment variable, read in one place.

Flags are the interface; these knobs are for diagnosis and benchmarks, or for settings that must
reach every process of a job without touching its command line. Each is read when asked for, so a
test can set it with monkeypatch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from elastictrain.step_list import parse_steps

ROLE = "ELASTICTRAIN_ROLE"
"""Set by a rank's supervisor (``--replace-in-place``) on its children: ``worker`` (training from
the start) or ``spare``."""
UNHEALTHY = "ELASTICTRAIN_CHAOS_UNHEALTHY"
NAN = "ELASTICTRAIN_CHAOS_NAN"
SPIKE = "ELASTICTRAIN_CHAOS_SPIKE"
BITFLIP = "ELASTICTRAIN_CHAOS_BITFLIP"
AGENT_PID = "ELASTICTRAIN_AGENT_PID"
"""Set by a rank's supervisor on its children: the torchrun agent's pid (their parent is the
supervisor, not the agent)."""


def log_level(default: str) -> str:
    """``ELASTICTRAIN_LOG_LEVEL``: every rank's log level (default: INFO on rank 0, WARNING on the
    others, so N ranks do not print N copies of the same story)."""
    return os.environ.get("ELASTICTRAIN_LOG_LEVEL", default)


def control_interval_s() -> float:
    """``ELASTICTRAIN_CONTROL_INTERVAL_S``: seconds' worth of steps between the agreement
    all-reduces (default 0.2; 0 agrees every step). A diagnostic, for ``bench --overhead``."""
    return float(os.environ.get("ELASTICTRAIN_CONTROL_INTERVAL_S", "0.2"))


def diagnostic_env_init() -> bool:
    """``ELASTICTRAIN_DIAGNOSTIC_ENV_INIT=1``: torch's plain ``env://`` init instead of the
    restart-safe handshake, only to measure the restart hazard that handshake fixes."""
    return os.environ.get("ELASTICTRAIN_DIAGNOSTIC_ENV_INIT") == "1"


def local_tier_root() -> str:
    """``ELASTICTRAIN_LOCAL_ROOT``: where the local tier's default per-job folders go (default
    /dev/shm): a node-local NVMe mount for every job of a cluster, or a test session's own folder.
    ``--local-checkpoint-dir`` overrides it for one job."""
    return os.environ.get("ELASTICTRAIN_LOCAL_ROOT", "/dev/shm")


def nccl_in_place() -> bool:
    """``ELASTICTRAIN_NCCL_IN_PLACE=1``: allow ``--replace-in-place`` on CUDA (NCCL). Its path is
    built (``epoch_end``) but has not yet run on GPUs beyond the GPU tier's one-device cases
    (docs/faults.md, "NCCL"); until it has, a CUDA job asks for it by name."""
    return os.environ.get("ELASTICTRAIN_NCCL_IN_PLACE") == "1"


def unhealthy() -> str | None:
    """``ELASTICTRAIN_CHAOS_UNHEALTHY=compute``: this process's self-check computes a wrong
    product, as a device that computes wrong would (``chaos --fault unhealthy-node`` sets it on
    one node's torchrun, to rehearse a node left out at its start). ``compute:R,...``: only for
    the processes of torchrun ranks R, ... (a test's way to pick the node whatever the
    rendezvous's order)."""
    value = os.environ.get(UNHEALTHY, "")
    check, _, ranks = value.partition(":")
    if ranks and os.environ.get("RANK") not in ranks.split(","):
        return None
    return check or None


def nan_steps() -> frozenset[int]:
    """``ELASTICTRAIN_CHAOS_NAN=STEPS[:R,...]`` (``chaos --fault nan``): this process multiplies
    its loss by NaN at those global steps (``120,130-132``), each time it trains them, so its
    gradient goes NaN in the backward as a bad sample's would. ``:R,...``: only the processes of
    torchrun ranks R, ...; empty for every other process."""
    return _chaos_steps(NAN)


def spike_steps() -> frozenset[int]:
    """``ELASTICTRAIN_CHAOS_SPIKE=STEPS[:R,...]`` (``chaos --fault spike``): as the NaN knob, the
    loss multiplied by ``SPIKE_FACTOR`` instead: a batch that blows the loss up, and the step's
    update with it."""
    return _chaos_steps(SPIKE)


SPIKE_FACTOR = 30.0


def bitflip_steps() -> frozenset[int]:
    """``ELASTICTRAIN_CHAOS_BITFLIP=STEP[:R,...]`` (``chaos --fault bitflip``): after its
    optimizer step at STEP, this process flips one bit of one parameter, once in its life: a
    device that corrupts memory silently, once (a replay of the step is clean)."""
    return _chaos_steps(BITFLIP)


def _chaos_steps(name: str) -> frozenset[int]:
    steps, _, ranks = os.environ.get(name, "").partition(":")
    if ranks and os.environ.get("RANK") not in ranks.split(","):
        return frozenset()
    return parse_steps(steps, name)


def role() -> str | None:
    """``ELASTICTRAIN_ROLE``: this process's role under a supervisor, or None for the process
    torchrun started."""
    return os.environ.get(ROLE)


def agent_pid(environ: Mapping[str, str] = os.environ) -> int:
    """``ELASTICTRAIN_AGENT_PID``: the torchrun agent's pid, as the supervisor named it; else this
    process's parent (the agent itself)."""
    return int(environ.get(AGENT_PID, os.getppid()))

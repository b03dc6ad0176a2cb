"""Library mode's process groups: :func:`init_distributed`, the runner's restart-safe handshake for
a loop the user writes; and in place (``init_distributed(replace_in_place=True)`` and
:meth:`CheckpointManager.run`), the survivors of a peer's death keep training, as under the
runner's ``--replace-in-place``, with the same pieces (``supervisor``, ``membership``, the live
resume).

- ``init_distributed`` turns the process torchrun started into the rank's supervisor: it runs the
  same command line again as the training process and as a spare. The spare runs the script up to
  its ``init_distributed`` call (every import at its top, and torch's first optimizer) and waits
  there; told to go, it joins the survivors' next membership epoch and returns, and the script
  goes on as a replacement: its :meth:`CheckpointManager.resume` takes the state from a survivor.
- A survivor's :meth:`CheckpointManager.run` sees the death as an error from a collective in the
  step, keeps its state at the newest completed step, and builds the next epoch here:
  :func:`regroup`, then a fresh session, the agreement and the live resume (``manager``).

This module holds the epoch the process is in: its torchrun identity, members and groups.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elastictrain import agreement, epoch_end, membership, supervisor
from elastictrain import dist as edist
from elastictrain.env import DistEnv, read_env
from elastictrain.errors import EXIT_INIT_TIMEOUT
from elastictrain.liveness import Liveness
from elastictrain.membership import LiveState

logger = logging.getLogger(__name__)


_BEAT_S = 2.0  # seconds between liveness beats (the runner's --heartbeat-seconds default)


@dataclass(frozen=True)
class Settings:
    """``init_distributed``'s arguments, kept for every epoch after the first."""

    init_timeout: float
    timeout: float
    silent_timeout: float
    replace_wait: float
    replace_timeout: float


@dataclass
class Epoch:
    """The membership epoch this process trains in."""

    env: DistEnv
    """torchrun's identity of this rank (its rank is the torchrun rank, fixed for the process)."""
    device: torch.device
    settings: Settings
    members: list[int]
    """The epoch's torchrun ranks, in its rank order."""
    groups: edist.ProcessGroups
    liveness: Liveness
    died_at: float | None = None
    """A replacement's first epoch: when the death it replaces was seen."""

    @property
    def rank(self) -> int:
        return self.members.index(self.env.rank)


_epoch: Epoch | None = None


def init_distributed(
    *,
    init_timeout: float = 900.0,
    timeout: float = 600.0,
    backend: str | None = None,
    silent_timeout: float = 15.0,
    replace_in_place: bool = False,
    replace_wait: float = 0.5,
    replace_timeout: float = 60.0,
    max_replacements: int = 3,
) -> torch.device:
    """Library mode's ``init_process_group``: the runner's restart-safe handshake for your loop.

    Call it once, first thing, on every rank under ``torchrun``; then build your model on the
    returned device and wrap it in DDP as usual. It picks ``cuda:LOCAL_RANK`` (nccl) when CUDA is
    present, else the CPU (gloo), and builds the default process group on a store no earlier
    attempt has written to, so a restart after a SIGKILL never connects to dead workers (plain
    ``init_process_group`` does, now and then: "Gloo connectFullMesh failed"). Run without
    torchrun it initialises nothing and returns the device for a single process.

    Args:
        init_timeout: seconds for the handshake and process-group creation.
        timeout: seconds a collective may wait for the slowest rank.
        backend: ``"gloo"`` or ``"nccl"``; default from the device.
        silent_timeout: seconds without a peer's heartbeat before this rank exits 8 naming it, so
            torchrun re-forms the group without a frozen host (``elastictrain.liveness``, beats
            every 2 s from a thread of its own); 0 turns it off.
        replace_in_place: keep the survivors of a peer's death training (CPU/gloo, DDP; NCCL
            with ``ELASTICTRAIN_NCCL_IN_PLACE=1``, docs/faults.md "NCCL"): this process becomes
            the rank's supervisor and runs the script again as the training process and a spare
            (``elastictrain.supervisor``); train with
            :meth:`CheckpointManager.run`. A frozen peer is dropped after ``silent_timeout``.
        replace_wait, replace_timeout, max_replacements: the runner's ``--replace-wait``,
            ``--replace-timeout`` and ``--max-replacements`` (docs/faults.md).

    Raises:
        InitTimeoutError: a rank did not join within ``init_timeout``.
        StoreSilentError: the job's store (torchrun's rendezvous store, ``job_store``) accepted
            the connection and did not answer within ``silent_timeout``: its host is frozen.
    """
    env = read_env()
    device = edist.pick_device(env)
    if backend == "gloo":
        device = torch.device("cpu")
    if replace_in_place and env.launched_by_torchrun and not dist.is_initialized():
        timeouts = Settings(init_timeout, timeout, silent_timeout, replace_wait, replace_timeout)
        return start(env, device, timeouts, max_replacements)
    if env.launched_by_torchrun and not dist.is_initialized():
        liveness = Liveness(env.rank, env.world_size, interval_s=_BEAT_S, silent_s=silent_timeout)
        edist.init_process_groups(
            env,
            device,
            init_timeout=init_timeout,
            collective_timeout=timeout,
            checkpoint_timeout=timeout,
            liveness=liveness,
        )
        liveness.start()  # a daemon: it ends with the process
    return device


def current() -> Epoch | None:
    """The epoch, when this process was started by ``init_distributed(replace_in_place=True)``."""
    return _epoch


def start(
    env: DistEnv, device: torch.device, settings: Settings, max_replacements: int
) -> torch.device:
    """``init_distributed(replace_in_place=True)`` under torchrun: supervise (never returns), or
    wait as a spare, or train from the start; then the first epoch's process group."""
    global _epoch
    if device.type != "cpu":
        epoch_end.refuse_unverified_nccl(device, "init_distributed(replace_in_place=True)")
    role = supervisor.role()
    if role is None:
        # The process torchrun watches: it runs this same command line as its children.
        sys.exit(
            supervisor.supervise(
                [],
                program=tuple(sys.orig_argv[1:]),
                max_replacements=max_replacements,
                rank=env.rank,
                stopped_s=settings.silent_timeout or None,
            )
        )
    died_at = None
    if role == "spare":
        _warm()
        logger.warning("spare for rank %d ready: waiting to stand in", env.rank)
        died_at = supervisor.wait_for_go()
        if died_at is None:  # the supervisor is gone or ended the spare's wait
            sys.exit(0)
    _epoch = _open(env, device, settings, None, died_at)
    return device


def leave(carry: LiveState) -> None:
    """A survivor, the moment it sees a peer's death: ``membership.leave`` (the others' blocked
    collectives fail, and this rank is counted back for the next epoch)."""
    failed = _epoch
    carry.nonce, carry.members = failed.groups.attempt.nonce, failed.members
    carry.silent = membership.silent_members(failed.liveness, failed.members)
    membership.leave(carry, failed.groups.store, failed.env, failed.groups.connections)


def regroup(carry: LiveState) -> Epoch:
    """A survivor, after :func:`leave`: tear down the failed epoch's groups and build the next
    one's with whoever is back. Raises ``SystemExit(3)`` if the others went on without it."""
    global _epoch
    failed = _epoch
    failed.liveness.stop(wait=False)
    edist.shutdown()
    _epoch = _open(failed.env, failed.device, failed.settings, carry, None)
    return _epoch


def _open(
    env: DistEnv,
    device: torch.device,
    settings: Settings,
    carry: LiveState | None,
    died_at: float | None,
) -> Epoch:
    in_place = carry is not None or died_at is not None
    members = membership.next_members(
        env,
        carry,
        died_at,
        wait_s=settings.replace_wait,
        timeout_s=settings.replace_timeout,
        silent_s=settings.silent_timeout,
        beat_s=_BEAT_S,
    )
    if env.rank not in members:
        logger.error(
            "rank %d: the other ranks went on without this one (back after replace_wait); "
            "exiting %d so torchrun restarts the group at full size",
            env.rank,
            EXIT_INIT_TIMEOUT,
        )
        sys.exit(EXIT_INIT_TIMEOUT)
    here = dataclasses.replace(env, rank=members.index(env.rank), world_size=len(members))
    connections = None  # the epoch's, once its groups exist: all its silence may shut
    liveness = Liveness(
        here.rank,
        here.world_size,
        interval_s=_BEAT_S,
        silent_s=settings.silent_timeout,
        on_silent=lambda reason: membership.drop_silent(liveness, reason, env, connections),
    )
    groups = edist.init_process_groups(
        here,
        device,
        init_timeout=settings.replace_timeout if in_place else settings.init_timeout,
        collective_timeout=settings.timeout,
        checkpoint_timeout=settings.timeout,
        liveness=liveness,
        timeout_flag="replace_timeout" if in_place else "init_timeout",
        store_up=in_place,
    )
    connections = groups.connections
    if groups.store is not None:
        if here.rank == 0:
            membership.publish(groups.store, groups.attempt.nonce, members)
        membership.watch_epoch(groups.store, groups.attempt.nonce, env, groups.connections)
    liveness.start()
    return Epoch(env, device, settings, members, groups, liveness, died_at)


def _warm() -> None:
    """A spare, before it waits: pay now what the replacement's first step would (the first
    optimizer imports torch._dynamo: most of a start's build time; DDP)."""
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def agree(carry: LiveState | None, group: dist.ProcessGroup) -> agreement.Epoch:
    """Every rank of the epoch, as its session resumes: how it began (``agreement.agree``)."""
    epoch = _epoch
    dropped = sorted(set(carry.members) - set(epoch.members)) if carry is not None else []
    return agreement.agree(
        carry,
        epoch.died_at,
        group=group,
        store=epoch.groups.store,
        rank=epoch.rank,
        members=epoch.members,
        dropped=dropped,
    )

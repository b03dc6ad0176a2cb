"""Library mode: your own loop, with the runner's process groups and checkpoints.

- :func:`init_distributed` is the runner's restart-safe handshake for a loop the user writes,
  through the same epoch driver (``inplace.driver``). With ``replace_in_place=True`` the process
  torchrun started becomes the rank's supervisor: it runs the same command line again as the
  training process and as a spare. The spare runs the script up to its ``init_distributed`` call
  (every import at its top, and torch's first optimizer) and waits there; told to go, it joins
  the survivors' next membership epoch and returns, and the script goes on as a replacement: its
  :meth:`CheckpointManager.resume` takes the state from a survivor.
- :class:`CheckpointManager` is the checkpoint facade (``checkpoint.manager``) plus
  :meth:`CheckpointManager.run`, the loop that recovers in place (``inplace.recovering``): a
  survivor sees a peer's death as an error from a collective in the step, keeps its state at the
  newest completed step, and the driver builds the next epoch; the live resume follows.

The process's driver is held here (:func:`driver`): ``init_distributed`` returns a device, as
``init_process_group``'s users expect, and the manager built later finds the epoch through it.
"""

from __future__ import annotations

import atexit
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastictrain.checkpoint import manager as checkpoint_manager
from elastictrain.checkpoint.checkpointer import Resumed
from elastictrain.checkpoint.resume.live import Live
from elastictrain.checkpoint.sharded.format import is_sharded
from elastictrain.checkpoint.state.train_state import TrainState
from elastictrain.cluster.env import DistEnv, read_env
from elastictrain.cluster.groups import pick_device
from elastictrain.cluster.self_check import check_or_stop
from elastictrain.config import check_silent_timeout
from elastictrain.errors import EXIT_INIT_TIMEOUT, ConfigError
from elastictrain.inplace import epoch_end, recovering, supervisor
from elastictrain.inplace.driver import EpochDriver
from elastictrain.inplace.epoch import EpochSettings
from elastictrain.inplace.members import LiveState
from elastictrain.inplace.spares import warm_spare
from elastictrain.inplace.states import EpochState
from elastictrain.train.loop_guards import LoopGuards

logger = logging.getLogger(__name__)

_driver: EpochDriver | None = None
"""The process's epoch driver, once :func:`init_distributed` built the groups (architecture
allow-list: one per process, found by the manager built after it)."""


def init_distributed(
    *,
    init_timeout: float = 900.0,
    timeout: float = 600.0,
    backend: str | None = None,
    silent_timeout: float = 15.0,
    heartbeat_seconds: float = 2.0,
    replace_in_place: bool = False,
    replace_wait: float = 0.5,
    replace_timeout: float = 60.0,
    max_replacements: int = 3,
    self_check: bool = True,
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
            torchrun re-forms the group without a frozen host (``elastictrain.cluster.liveness``, beats
            from a thread of its own); 0 turns it off.
        heartbeat_seconds: seconds between two beats (the runner's ``--heartbeat-seconds``).
        replace_in_place: keep the survivors of a peer's death training (CPU/gloo, DDP; NCCL
            with ``ELASTICTRAIN_NCCL_IN_PLACE=1``, docs/faults.md "NCCL"): this process becomes
            the rank's supervisor and runs the script again as the training process and a spare
            (``elastictrain.inplace.supervisor``); train with
            :meth:`CheckpointManager.run`. A frozen peer is dropped after ``silent_timeout``.
        replace_wait, replace_timeout, max_replacements: the runner's ``--replace-wait``,
            ``--replace-timeout`` and ``--max-replacements`` (docs/faults.md).
        self_check: at a start (not a replacement), every node's self-check
            (``elastictrain.cluster.self_check``); a failing node stops every rank with
            ``SelfCheckFailedError`` (exit 2): library mode cannot leave a node out at its start.

    Raises:
        InitTimeoutError: a rank did not join within ``init_timeout``.
        SelfCheckFailedError: a node failed its self-check (``self_check``).
        StoreSilentError: the job's store (torchrun's rendezvous store, ``job_store``) accepted
            the connection and did not answer within ``silent_timeout``: its host is frozen.
    """
    global _driver
    env = read_env()
    device = pick_device(env)
    if backend == "gloo":
        device = torch.device("cpu")
    if not env.launched_by_torchrun or dist.is_initialized():
        return device
    check_silent_timeout(silent_timeout, heartbeat_seconds, str)
    settings = EpochSettings(
        replace_in_place=replace_in_place,
        init_timeout=init_timeout,
        collective_timeout=timeout,
        checkpoint_timeout=timeout,
        replace_wait=replace_wait,
        replace_timeout=replace_timeout,
        silent_timeout=silent_timeout,
        beat_s=heartbeat_seconds,
        init_flag="init_timeout",
        replace_flag="replace_timeout",
    )
    role = _supervise_unless_a_child(env, device, settings, max_replacements)
    _driver = EpochDriver(env, device, settings, spare=role == "spare")
    atexit.register(_close_at_exit)
    died_at = None
    if role == "spare":
        died_at = _driver.wait_as_spare(warm_spare, logging.WARNING)
        if died_at is None:
            sys.exit(0)  # the supervisor is gone or ended the spare's wait
    if _driver.form(None, died_at) is None:
        logger.error(
            "rank %d: the other ranks went on without this one (back after replace_wait); "
            "exiting %d so torchrun restarts the group at full size",
            env.rank,
            EXIT_INIT_TIMEOUT,
        )
        sys.exit(EXIT_INIT_TIMEOUT)
    if self_check and died_at is None:
        epoch = _driver.epoch
        check_or_stop(
            device,
            env,
            store=epoch.groups.store,
            group=epoch.groups.control,
            rtt_limit_s=heartbeat_seconds,
        )
    return device


def _close_at_exit() -> None:
    """Before the interpreter finalizes (atexit runs first), end every thread the epochs started:
    the beats (with a last one that says done, so a peer still closing up does not find this rank
    silent) and the watch of the epoch's end (``EpochDriver.close``). A thread still inside a
    store request when the interpreter finalizes aborts the process if the request returns then
    (``inplace.epoch_end``'s docstring): a clean finish would exit -6, and torchrun restart it.
    The runner closes its driver itself and skips finalization."""
    if _driver is not None:
        _driver.close()


def driver() -> EpochDriver | None:
    """The process's epoch driver, once :func:`init_distributed` built its groups."""
    return _driver


def _supervise_unless_a_child(
    env: DistEnv, device: torch.device, settings: EpochSettings, max_replacements: int
) -> str | None:
    """``replace_in_place`` under torchrun: the process torchrun started supervises (never
    returns); its children return their role (``worker``, ``spare``). None: not in place."""
    if not settings.replace_in_place:
        return None
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
    return role


class CheckpointManager(checkpoint_manager.CheckpointManager):
    __doc__ = checkpoint_manager.CheckpointManager.__doc__

    def _open_session(self) -> None:
        super()._open_session()
        if _driver is not None:  # the epoch's transitions go to this session's event log
            _driver.attach(self._session.events, self._last_words, self._watchdog)

    def _begin(self, carry: Any) -> tuple[dict[str, Any], Live | None]:
        """Every member agrees how the epoch began, over this manager's group (the driver), once
        per epoch: a second manager in the same epoch (or a second resume) has nothing to agree."""
        if _driver is None or _driver.state != EpochState.FORMING:
            return {}, None
        start = _driver.agree(self._group)
        return start.start_fields(), start.live(carry)

    def _resumed_epoch(self, resumed: Resumed) -> None:
        if _driver is None or _driver.state != EpochState.RESUMING:
            return
        _driver.training(resumed.step)
        connections = _driver.epoch.groups.connections
        if _driver.settings.replace_in_place and connections is not None:
            # Every group of the epoch is built now (this session's): its end may shut each.
            connections.learn(self._group)

    def _ending(self, step: int) -> None:
        if _driver is not None and _driver.state == EpochState.TRAINING:
            _driver.finish(step, nodes=self._session.nodes)

    def emit(self, event: str, **fields: Any) -> None:
        """An event in the run's log (rank 0 writes it)."""
        self._session.events.emit(event, **fields)

    def run(
        self,
        train_step: Callable[[int, nn.Module], dict[str, Any] | None],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        *,
        start: int,
        stop: int,
        wrap: Callable[[nn.Module], nn.Module] | None = None,
        skip_nonfinite: bool = True,
        max_consecutive_skips: int = 3,
        compare_replicas_every: int | None = 100,
    ) -> dict[str, Any] | None:
        """Train steps ``start`` .. ``stop - 1``: for each, ``train_step(step, net)`` (the forward
        and backward passes; it returns the step's ``extra`` or None), then the optimizer and
        scheduler steps and :meth:`step`. ``net`` is ``wrap(model)`` (e.g. ``DDP``). Returns the
        last step's ``extra``.

        Under ``init_distributed(replace_in_place=True)``, a peer's death is recovered here: this
        rank keeps its state at the newest completed step, the ranks regroup with the dead rank's
        replacement (or without a lost node), the state of the newest step any survivor holds is
        loaded everywhere, ``net`` is wrapped anew and the step in flight is redone. So
        ``train_step`` must run every collective of its step itself (DDP's backward does) and
        read the rank and world size from ``torch.distributed`` each time (they change when a
        node is dropped), and its batch must depend on the step alone. Anything else raises.
        After each wrap (DDP), ``train_step`` is called once more and discarded, in eval mode
        (``inplace.recovering.prime_buckets``): every real step then sums in the same order,
        wherever it runs. The first step of each epoch is a ``first_step`` event, as the
        runner's.

        The runner's numerical guards hold here too (``train.loop_guards``, docs/faults.md): a
        step whose gradient is not finite is skipped on every rank (``skip_nonfinite``); more
        than ``max_consecutive_skips`` in a row roll back to the newest copy before them and
        skip them (``train_step`` is not called for those steps); DDP replicas' parameters are
        compared every ``compare_replicas_every`` steps (None: never), a difference rolled
        back. A fault that comes back at once stops every rank with ``NumericalFaultError``.
        """
        self._require_resumed("run")
        _check_guards(max_consecutive_skips, compare_replicas_every)
        in_place = _driver is not None and _driver.settings.replace_in_place
        if in_place and is_sharded(model):
            # A sharded model is bound to the failed epoch's mesh: it must be built and sharded
            # again, which only the code that built it can do (the runner does: its Task).
            raise ConfigError(
                "CheckpointManager.run recovers DDP models in place; this model is sharded "
                "(FSDP2). Train it with the runner (--replace-in-place --parallel fsdp|hsdp), "
                "or drop replace_in_place from init_distributed: a death then restarts the group."
            )
        guards = {
            "skip_nonfinite": skip_nonfinite,
            "max_consecutive_skips": max_consecutive_skips,
            "compare_replicas_every": compare_replicas_every,
        }
        return recovering.run_steps(
            _Epochs(self, guards),
            _driver if in_place else None,
            train_step,
            TrainState(model, optimizer, scheduler, self.extra),
            start=start,
            stop=stop,
            wrap=wrap or (lambda m: m),
        )


class _Epochs:
    """What the recovering loop asks of the manager (``inplace.recovering``)."""

    def __init__(self, manager: CheckpointManager, guards: dict[str, Any]) -> None:
        self._m, self._guards = manager, guards

    def stop_if_told(self, step: int, state: TrainState) -> None:
        """Before an epoch's first step (``CheckpointSession.stop_if_told``)."""
        self._m._session.stop_if_told(step, state)

    def guards(self, model: nn.Module, start: int) -> LoopGuards:
        """This epoch's numerical guards (its group, its session)."""
        return LoopGuards(self._m._session, model, start=start, **self._guards)

    @property
    def extra(self) -> dict[str, Any] | None:
        return self._m.extra

    @property
    def last_committed(self) -> int | None:
        return self._m.last_committed

    def step(self, *args: Any) -> bool:
        return self._m.step(*args)

    def _ending(self, step: int) -> None:
        self._m._ending(step)

    def emit(self, event: str, **fields: Any) -> None:
        self._m.emit(event, **fields)

    def abandon_epoch(self) -> None:
        self._m._session.abandon()
        self._m._group = None  # the failed epoch's: its default group's teardown ends it

    def open_epoch(self) -> None:
        self._m._open_session()

    def resume_epoch(self, state: TrainState, carry: LiveState) -> Resumed:
        return self._m._resume_epoch(state, carry)


def _check_guards(max_consecutive_skips: int, compare_replicas_every: int | None) -> None:
    if not (isinstance(max_consecutive_skips, int) and max_consecutive_skips >= 1):
        raise ConfigError(
            f"max_consecutive_skips must be an int >= 1, got {max_consecutive_skips!r}."
        )
    if compare_replicas_every is not None and not (
        isinstance(compare_replicas_every, int) and compare_replicas_every >= 1
    ):
        raise ConfigError(
            "compare_replicas_every must be an int >= 1, or None to never compare, got "
            f"{compare_replicas_every!r}."
        )

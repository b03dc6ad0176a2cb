"""Library mode: elastictrain's checkpointing inside your own training loop.

    device = elastictrain.init_distributed()             # restart-safe; instead of init_process_group
    ckpt = CheckpointManager("s3://bucket/run1", checkpoint_every_steps=500, keep_last=3)
    start = ckpt.resume(model, optimizer, scheduler)      # 0 when there is no checkpoint yet
    for step in range(start, total_steps):
        ...                                                # your forward/backward/optimizer step
        ckpt.step(step + 1, model, optimizer, scheduler)   # saves when the schedule says so
    ckpt.save(total_steps, model, optimizer, scheduler, final=True)
    ckpt.close()

A thin facade over :class:`~elastictrain.checkpoint.session.CheckpointSession`, the very sequence the
runner drives: the same commit protocol, background persists, retention, fencing of older writers,
storage retries, agreed preemption (SIGTERM or Ctrl-C: every rank commits the current step and
raises :class:`Preempted`, exit 75) and, with ``hang_timeout``, the hang watchdog. Its settings
are the runner's checkpoint flags, by the same names. What the runner
does beyond this (data sharding, per-step seeding) stays your loop's business.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastictrain import epoch_end, library, membership
from elastictrain.checkpoint.api import Reason
from elastictrain.checkpoint.manager_args import config_from, signature
from elastictrain.checkpoint.resume.live import Live
from elastictrain.checkpoint.session import CheckpointSession, Resumed, install_stop_signals
from elastictrain.checkpoint.sharded.format import is_sharded
from elastictrain.checkpoint.state import train_state as tstate
from elastictrain.checkpoint.state.train_state import TrainState, unwrap
from elastictrain.dist import default_group_is_restart_safe
from elastictrain.env import read_env
from elastictrain.errors import ConfigError, Preempted
from elastictrain.membership import LiveState
from elastictrain.observe.events import LastWords
from elastictrain.watchdog import HangWatchdog

__all__ = ["CheckpointManager", "Preempted"]

logger = logging.getLogger(__name__)

RESTART_UNSAFE = (
    "This job's process group was made by torch.distributed.init_process_group on torchrun's "
    "shared rendezvous store. After a worker is killed, torchrun's restart can read the dead "
    "workers' addresses from that store: a restart then fails with 'Gloo connectFullMesh failed "
    "... Connection refused' or hangs in init_process_group for its timeout (30 minutes by "
    "default), and the restart budget runs out (measured on torch 2.13: 3 restarts of 8). Fix: call "
    "elastictrain.init_distributed() instead of init_process_group (it builds the group on a "
    "store no earlier attempt wrote to), or start torchrun with "
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment."
)
_warned_restart_unsafe = False


def _warn_if_restart_unsafe(rank: int, on_agent_store: bool) -> None:
    """Once per process, on rank 0: a loop ported from the DDP tutorial keeps its own
    ``init_process_group``, and nothing else would tell its user why restarts fail (issue 36)."""
    global _warned_restart_unsafe
    if _warned_restart_unsafe or rank != 0 or not on_agent_store:
        return
    if not default_group_is_restart_safe():
        _warned_restart_unsafe = True
        logger.warning(RESTART_UNSAFE)


class CheckpointManager:
    """Checkpoints for a custom loop. Under torch.distributed, construct it on every rank after
    :func:`elastictrain.init_distributed` (it creates one gloo group for its barriers); alone, it
    needs nothing.

    Its keyword arguments are exactly the fields of :class:`~elastictrain.config.CheckpointConfig`
    (each one is the runner's flag of the same name: ``keep_last`` is ``--keep-last``; see
    docs/cli.md), plus two of library mode's own:

    - ``map_location``: where resumed tensors go; default the device of the model's first
      parameter.
    - ``hang_timeout``: seconds between two :meth:`step` calls after which this rank is hung: it
      dumps every thread's Python stack and exits 4, so torchrun restarts the group instead of
      every rank waiting out the process group's timeout. Before the first step, and during
      resume and saves, ``checkpoint_timeout`` applies instead. Off (None) by default, since it
      ends the process. Under torchrun it also exits (6) when the agent is gone.

    Library mode's defaults differ from the runner's in one place: there is no schedule unless
    you give one (``checkpoint_every_steps``, ``checkpoint_every_seconds``).

    Raises:
        ConfigError: a value that can never work, or an unknown keyword; the message names it.
    """

    def __init__(
        self,
        checkpoint_dir: str | None = None,
        *,
        map_location: str | torch.device | None = None,
        hang_timeout: float | None = None,
        **settings: Any,
    ) -> None:
        if hang_timeout is not None and not hang_timeout > 0:
            raise ConfigError(f"hang_timeout must be > 0, got {hang_timeout!r}.")
        config = config_from(checkpoint_dir, settings)
        env = read_env()
        if dist.is_available() and dist.is_initialized():
            env = dataclasses.replace(env, rank=dist.get_rank())
            _warn_if_restart_unsafe(env.rank, env.use_agent_store)
        # Why this process ended early, for the run report: given to all that may end it.
        self._last_words = LastWords(config.event_log, env.rank)
        self._watchdog = None
        if hang_timeout is not None:
            self._watchdog = HangWatchdog(
                hang_timeout,
                startup_s=config.checkpoint_timeout,
                agent_pid=os.getppid() if env.under_agent else None,  # our parent is the agent
                budget_names=("hang_timeout", "checkpoint_timeout"),
                last_words=self._last_words,
            ).start()
        # Python only lets the main thread install signal handlers.
        main_thread = threading.current_thread() is threading.main_thread()
        if config.preempt_signals and not main_thread:
            logger.warning(
                "CheckpointManager built outside the main thread: %s will not checkpoint before "
                "stopping; build it in the main thread, or pass preempt_signals=()",
                "/".join(config.preempt_signals),
            )
        self._signals = (
            install_stop_signals(config, last_words=self._last_words) if main_thread else None
        )
        self.config = config
        self._open_session()
        self.map_location = map_location
        self._resumed = False
        self.extra: dict[str, Any] | None = None
        """The ``extra`` dict saved with the checkpoint :meth:`resume` loaded, else None."""

    def _open_session(self) -> None:
        """This epoch's gloo group and checkpoint session (a new one after an in-place recovery)."""
        config, env = self.config, read_env()
        alone = not (dist.is_available() and dist.is_initialized())
        if not alone:  # torch.distributed knows best where this process sits
            env = dataclasses.replace(env, rank=dist.get_rank(), world_size=dist.get_world_size())
        self._group = (
            None
            if alone
            else dist.new_group(
                backend="gloo", timeout=timedelta(seconds=config.checkpoint_timeout)
            )
        )
        self._session = CheckpointSession(
            config,
            env=env,
            generation=time.time_ns(),  # claim() lifts it above every earlier writer's
            gate=self._group,
            watchdog=self._watchdog,
            signals=self._signals,
            last_words=self._last_words,
        )

    @property
    def last_committed(self) -> int | None:
        """The newest durable step resumed from or committed (rank 0 also counts background
        commits); a resume from node memory leaves the durable tier's newest here."""
        return self._session.last_committed

    def resume(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None
    ) -> int:
        """Load the newest checkpoint that verifies into ``model``/``optimizer``/``scheduler`` in
        place, on every rank, and return the number of completed steps it holds (0: none yet).

        Always call it once before saving, even on a fresh start: it proves the location is
        writable, and claims it so that a stale writer of an earlier run can never commit again.

        Raises:
            CheckpointMismatchError: the checkpoint is of another model; nothing is changed.
            StorageNotUsableError: the location is missing, read-only, unreachable, or the
                credentials are rejected (the message says which).
        """
        resumed = self._resume_epoch(TrainState(model, optimizer, scheduler), carry=None)
        self._resumed = True
        return resumed.step

    def _resume_epoch(self, state: TrainState, carry: LiveState | None) -> Resumed:
        """Every rank, as an epoch begins. In place (``init_distributed(replace_in_place=True)``)
        the ranks first agree how it began (``library.agree``), and the state comes from the
        survivor holding the newest step when one does; otherwise from the checkpoints."""
        device = torch.device(self.map_location or _first_device(unwrap(state.model)))
        epoch = library.agree(carry, self._group) if library.current() else None
        self._session.emit_start(**(epoch.start_fields() if epoch else {}))
        live = Live.of(carry, epoch) if epoch is not None and epoch.in_place else None
        resumed = self._session.resume(state, device, live)
        self.extra = resumed.extra
        if epoch is not None and library.current().groups.connections is not None:
            # Every group of the epoch is built now (this session's): its end may shut each.
            library.current().groups.connections.learn(self._group)
        return resumed

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
        (:func:`_prime_buckets`): every real step then sums in the same order, wherever it runs.
        """
        self._require_resumed("run")
        if library.current() is not None and is_sharded(model):
            # A sharded model is bound to the failed epoch's mesh: it must be built and sharded
            # again, which only the code that built it can do (the runner does: its Task).
            raise ConfigError(
                "CheckpointManager.run recovers DDP models in place; this model is sharded "
                "(FSDP2). Train it with the runner (--replace-in-place --parallel fsdp|hsdp), "
                "or drop replace_in_place from init_distributed: a death then restarts the group."
            )
        wrap = wrap or (lambda m: m)
        net, step, extra, primed = wrap(model), start, self.extra, False
        epoch = library.current()
        gate = epoch_end.update_gate(epoch.device, twins=False) if epoch else None
        while step < stop:
            try:
                if not primed:  # after each wrap; a peer lost meanwhile is recovered as below
                    primed = _prime_buckets(train_step, step, net, model, optimizer)
                optimizer.zero_grad(set_to_none=True)
                extra = train_step(step, net)
                if gate is not None:  # CUDA: the step's collectives have run everywhere
                    gate()
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                step += 1  # completed: what this rank's state holds from here on
                self.step(step, model, optimizer, scheduler, extra)
            except Exception as e:
                if library.current() is None or not membership.is_peer_loss(e):
                    raise
                step = self._recover(e, TrainState(model, optimizer, scheduler, extra), step)
                net, extra, primed = wrap(model), self.extra, False
        return extra

    def _recover(self, error: Exception, state: TrainState, step: int) -> int:
        """A peer's process died during ``step``: the next epoch, resumed in place; its step."""
        captured = tstate.capture(state, step=step)
        carry = LiveState(step, captured, self.last_committed, time.time())
        carry.error = membership.error_line(error)
        logger.warning("a peer's training process is gone at step %d (%s); regrouping", step, error)
        library.leave(carry)
        self._session.abandon()
        self._group = None  # the failed epoch's: its default group's teardown ends it
        phase = contextlib.nullcontext()
        if self._watchdog is not None:
            timeout = library.current().settings.replace_timeout
            phase = self._watchdog.phase("in-place recovery", timeout, "replace_timeout")
        with phase:
            library.regroup(carry)
            self._open_session()
            return self._resume_epoch(state, carry).step

    def step(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        extra: dict[str, Any] | None = None,
    ) -> bool:
        """Call on every rank after every optimizer step, with the number of completed steps.

        Saves when ``checkpoint_every_steps`` divides ``step`` or ``checkpoint_every_seconds``
        passed on rank 0's clock.
        Rank 0's clock, a stop signal and a failed background persist become everyone's decision
        through one tiny all-reduce every ~0.2 s worth of steps, so every rank must call this at
        every step. Returns True when a checkpoint of ``step`` was taken.

        Raises:
            Preempted: a stop signal arrived; the checkpoint of ``step`` is committed.
            CheckpointFailedError: rank 0's background persist failed for good (every rank).
        """
        self._require_resumed("step")
        return self._session.step(step, TrainState(model, optimizer, scheduler, extra)).saved

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        extra: dict[str, Any] | None = None,
        *,
        final: bool = False,
    ) -> bool:
        """Checkpoint ``step`` now, on every rank. ``final=True`` commits before returning;
        otherwise ``async_checkpoint`` decides. ``extra``: your own state (tensors and plain Python
        values; loading never unpickles code), back as :attr:`extra` on resume. A step that is
        already committed is not written again. Returns False only when a non-final checkpoint
        was skipped under ``on_storage_failure='warn'``.

        Raises:
            ConfigError: called before :meth:`resume`.
            CheckpointFailedError: a final checkpoint could not be committed.
        """
        self._require_resumed("save")
        reason = Reason.FINAL if final else Reason.STEPS
        saved = self._session.save(step, TrainState(model, optimizer, scheduler, extra), reason)
        if final:
            self._session.emit_end(step)
        return saved

    def close(self) -> None:
        """Wait for a background persist still in flight; call it before the process exits.

        Raises:
            CheckpointFailedError: on rank 0, when that persist failed for good.
        """
        try:
            self._session.close()
        finally:
            if self._watchdog is not None:
                self._watchdog.stop()
                self._watchdog = None
            if self._group is not None and dist.is_initialized():
                # Our gloo group's threads must not outlive the loop: one torn down only at
                # interpreter exit can abort the process ("terminate called without an active
                # exception"), which torchrun counts as a failure and restarts.
                dist.destroy_process_group(self._group)
                self._group = None

    def _require_resumed(self, method: str) -> None:
        if not self._resumed:
            raise ConfigError(
                f"CheckpointManager.{method}() before resume(): call resume(model, optimizer) "
                "once first; it verifies the location and claims it for this run."
            )

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


CheckpointManager.__init__.__signature__ = signature()


def _prime_buckets(train_step, step: int, net: nn.Module, model: nn.Module, optimizer) -> bool:
    """DDP orders its gradient buckets anew after a wrapper's first backward, and past two ranks
    that order is gloo's summation order: a step redone right after a wrap (a recovery, a
    restart) would sum in another order than an uninterrupted run (about 2e-7 off at 4 ranks).
    So ``run`` primes them after each wrap, as the runner does (``loop.Trainer.prime_buckets``):
    one discarded ``train_step``, in eval mode, with torch's and Python's random state kept."""
    if not isinstance(net, nn.parallel.DistributedDataParallel):
        return True
    was_training, python_rng = net.training, random.getstate()
    cuda = [p.device for p in model.parameters() if p.device.type == "cuda"][:1]
    net.eval()  # the wrapper and the model: dropout off, BatchNorm's statistics untouched
    try:
        with torch.random.fork_rng(devices=cuda):
            train_step(step, net)
    finally:
        random.setstate(python_rng)
        optimizer.zero_grad(set_to_none=True)
        net.train(was_training)
    return True


def _first_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")

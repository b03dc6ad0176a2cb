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

import dataclasses
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastictrain.checkpoint.api import Reason
from elastictrain.checkpoint.manager_args import config_from, signature
from elastictrain.checkpoint.resume.live import Live
from elastictrain.checkpoint.session import CheckpointSession, Resumed, install_stop_signals
from elastictrain.checkpoint.state.train_state import TrainState, unwrap
from elastictrain.cluster.env import read_env
from elastictrain.cluster.groups import default_group_is_restart_safe
from elastictrain.errors import ConfigError, Preempted
from elastictrain.observe.events import LastWords
from elastictrain.runtime.watchdog import HangWatchdog

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

    def _resume_epoch(self, state: TrainState, carry: Any = None) -> Resumed:
        """Every rank, as an epoch begins: how it began (:meth:`_begin`), then the state, from a
        survivor's memory when :meth:`_begin` says so, else from the checkpoints."""
        device = torch.device(self.map_location or _first_device(unwrap(state.model)))
        start_fields, live = self._begin(carry)
        self._session.emit_start(**start_fields)
        resumed = self._session.resume(state, device, live)
        self.extra = resumed.extra
        self._resumed_epoch(resumed)
        return resumed

    def _begin(self, carry: Any) -> tuple[dict[str, Any], Live | None]:
        """How the epoch began (the ``start`` event's fields) and where its state comes from
        (None: the checkpoints). Library mode's in-place epochs agree it (``elastictrain.library``)."""
        return {}, None

    def _resumed_epoch(self, resumed: Resumed) -> None:
        """After the resume of each epoch (library mode's in-place epochs learn their groups)."""

    def _ending(self, step: int) -> None:
        """The final checkpoint is committed, before the end event (library mode's epoch ends)."""

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
            self._ending(step)
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


def _first_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")

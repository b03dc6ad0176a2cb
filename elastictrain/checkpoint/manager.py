"""Library mode: elastictrain's checkpointing inside your own training loop.

    device = elastictrain.init_distributed()             # restart-safe; instead of init_process_group
    ckpt = CheckpointManager("s3://bucket/run1", every_steps=500, keep_last=3)
    start = ckpt.resume(model, optimizer, scheduler)      # 0 when there is no checkpoint yet
    for step in range(start, total_steps):
        ...                                                # your forward/backward/optimizer step
        ckpt.step(step + 1, model, optimizer, scheduler)   # saves when the schedule says so
    ckpt.save(total_steps, model, optimizer, scheduler, final=True)
    ckpt.close()

A thin facade over :class:`~elastictrain.checkpoint.session.CheckpointSession`, the very sequence the
runner drives: the same commit protocol, background persists, retention, fencing of older writers,
storage retries, agreed preemption (SIGTERM or Ctrl-C: every rank commits the current step and
raises :class:`Preempted`, exit 75) and, with ``hang_timeout``, the hang watchdog. What the runner
does beyond this (data sharding, per-step seeding) stays your loop's business.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastictrain.checkpoint.persist import Reason
from elastictrain.checkpoint.session import (
    CheckpointSession,
    Preempted,
    SessionConfig,
    install_stop_signals,
)
from elastictrain.checkpoint.state import TrainState, unwrap
from elastictrain.errors import ConfigError
from elastictrain.watchdog import HangWatchdog

__all__ = ["CheckpointManager", "Preempted"]

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Checkpoints for a custom loop. Under torch.distributed, construct it on every rank after
    :func:`elastictrain.init_distributed` (it creates one gloo group for its barriers); alone, it
    needs nothing."""

    def __init__(
        self,
        url: str,
        *,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        keep_last: int = 3,
        keep_every_steps: int | None = None,
        async_save: bool = True,
        storage_options: dict[str, Any] | None = None,
        storage_retry_deadline: float = 120.0,
        on_storage_failure: str = "warn",
        timeout_s: float = 1800.0,
        map_location: str | torch.device | None = None,
        event_log: str | None = None,
        preempt_signals: Sequence[str] = ("SIGTERM",),
        hang_timeout: float | None = None,
        checksum: str = "xxh3",
        local_checkpoint: bool = True,
        local_checkpoint_dir: str | None = None,
        local_every_steps: int | str = "auto",
        local_overhead: float = 0.02,
    ) -> None:
        """
        Args:
            url: a local path or any fsspec URL (``s3://bucket/prefix``).
            every_steps, every_seconds: the schedule :meth:`step` follows (either, both or
                neither; 0 or None is off).
            keep_last, keep_every_steps: retention, as ``--keep-last`` / ``--keep-every-steps``.
            async_save: scheduled checkpoints persist on a background thread of rank 0.
            on_storage_failure: ``warn`` skips a scheduled checkpoint storage refused past the
                retry deadline; ``fail`` raises on every rank.
            timeout_s: budget for the barriers around resume and saves.
            map_location: where resumed tensors go; default the device of the model's first
                parameter.
            event_log: rank 0 appends start, resume, checkpoint, preempted and end events (JSON
                lines) to this local file, and any rank its last words; ``python -m elastictrain
                report`` draws it as it draws the runner's.
            preempt_signals: signals that mean "checkpoint this step and stop" (see
                :class:`Preempted`). Ctrl-C (SIGINT) does too while any are set; a second Ctrl-C
                exits 130 at once. ``()`` leaves every signal handler alone. :meth:`close` puts
                them back.
            hang_timeout: seconds between two :meth:`step` calls after which this rank is hung:
                it dumps every thread's Python stack and exits 4, so torchrun restarts the group
                instead of every rank waiting out the process group's timeout. Before the first
                step, and during resume and saves, ``timeout_s`` applies instead. Off (None) by
                default, since it ends the process. Under torchrun it also exits (6) when the
                agent is gone.
            checksum: ``xxh3`` (fast, the default) or ``sha256``, as ``--checksum``.
            local_checkpoint, local_checkpoint_dir, local_every_steps, local_overhead: the
                local tier, as ``--local-checkpoint`` and friends: each node's copy of the state
                on node-local storage (/dev/shm), preferred on resume when it is newer.

        Raises:
            ConfigError: a value that can never work; the message names the argument.
        """
        config = SessionConfig(
            url=url,
            storage_options=dict(storage_options or {}),
            every_steps=every_steps,
            every_seconds=every_seconds,
            keep_last=keep_last,
            keep_every_steps=keep_every_steps,
            async_save=async_save,
            storage_retry_deadline=storage_retry_deadline,
            on_storage_failure=on_storage_failure,
            timeout_s=timeout_s,
            hang_timeout=hang_timeout,
            preempt_signals=tuple(preempt_signals),
            event_log=event_log,
            checksum=checksum,
            local_checkpoint=local_checkpoint,
            local_checkpoint_dir=local_checkpoint_dir,
            local_every_steps=local_every_steps,
            local_overhead=local_overhead,
        )
        alone = not (dist.is_available() and dist.is_initialized())
        rank = 0 if alone else dist.get_rank()
        self._group = (
            None if alone else dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        )
        watchdog = None
        if hang_timeout is not None:
            under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ  # our parent is the agent
            watchdog = HangWatchdog(
                hang_timeout,
                startup_s=timeout_s,
                agent_pid=os.getppid() if under_torchrun else None,
                budget_names=("hang_timeout", "timeout_s"),
            ).start()
        # Python only lets the main thread install signal handlers.
        main_thread = threading.current_thread() is threading.main_thread()
        if preempt_signals and not main_thread:
            logger.warning(
                "CheckpointManager built outside the main thread: %s will not checkpoint before "
                "stopping; build it in the main thread, or pass preempt_signals=()",
                "/".join(preempt_signals),
            )
        self._session = CheckpointSession(
            config,
            rank=rank,
            world_size=1 if alone else dist.get_world_size(),
            generation=time.time_ns(),  # claim() lifts it above every earlier writer's
            gate=self._group,
            device=torch.device("cpu"),  # replaced in resume()
            watchdog=watchdog,
            signals=install_stop_signals(config) if main_thread else None,
        )
        self.map_location = map_location
        self._resumed = False
        self.extra: dict[str, Any] | None = None
        """The ``extra`` dict saved with the checkpoint :meth:`resume` loaded, else None."""

    @property
    def last_committed(self) -> int | None:
        """The newest step resumed from or committed (rank 0 also counts background commits)."""
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
        device = self.map_location or _first_device(unwrap(model))
        self._session.ckpt.device = torch.device(device)
        self._session.emit_start()
        resumed = self._session.resume(TrainState(model, optimizer, scheduler))
        self._resumed, self.extra = True, resumed.extra
        return resumed.step

    def step(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        extra: dict[str, Any] | None = None,
    ) -> bool:
        """Call on every rank after every optimizer step, with the number of completed steps.

        Saves when ``every_steps`` divides ``step`` or ``every_seconds`` passed on rank 0's clock.
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
        otherwise ``async_save`` decides. ``extra``: your own state (tensors and plain Python
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
            if self._session.watchdog is not None:
                self._session.watchdog.stop()
                self._session.watchdog = None
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


def _first_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")

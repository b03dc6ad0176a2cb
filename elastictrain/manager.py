"""Library mode: elastictrain's checkpointing inside your own training loop.

    ckpt = CheckpointManager("s3://bucket/run1", every_steps=500, keep_last=3)
    start = ckpt.resume(model, optimizer, scheduler)      # 0 when there is no checkpoint yet
    for step in range(start, total_steps):
        ...                                                # your forward/backward/optimizer step
        ckpt.step(step + 1, model, optimizer, scheduler)   # saves when the schedule says so
    ckpt.save(total_steps, model, optimizer, scheduler, final=True)
    ckpt.close()

It is the runner's own machinery (``Checkpointer``, ``Persister``, ``Control``): rank 0 writes
through the same commit protocol, with background persists, retention, fencing of older writers and
storage retries; every rank resumes from the newest checkpoint that verifies, read once by rank 0
and broadcast, with tensors mapped to this rank's device.

Preemption works as in the runner: a SIGTERM (``preempt_signals``) only sets a flag; at the next
agreed step :meth:`CheckpointManager.step` commits a checkpoint of that exact step on every rank and
raises :class:`Preempted`, a ``SystemExit(75)``, so an unmodified loop stops with nothing lost.
With ``hang_timeout`` set, the runner's hang watchdog guards the loop too. What the runner does
beyond this (data sharding, per-step seeding) stays your loop's business.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastictrain.checkpointing import Checkpointer, CheckpointSchedule
from elastictrain.control import Control
from elastictrain.errors import EXIT_PREEMPTED, ConfigError
from elastictrain.events import EventLog, LastWords
from elastictrain.watchdog import HangWatchdog, StopSignals, parse_signal

logger = logging.getLogger(__name__)


class Preempted(SystemExit):
    """Raised by :meth:`CheckpointManager.step` on every rank once a preemption signal has been
    agreed and the checkpoint of that step committed. Exit code 75, as the runner's: relaunch to
    continue. Catch it to clean up first; it is a ``SystemExit``, so ``except Exception`` will not."""

    def __init__(self, step: int, signal_name: str) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.step, self.signal_name = step, signal_name

    def __str__(self) -> str:
        return f"preempted ({self.signal_name}) at step {self.step}: checkpoint committed"


class CheckpointManager:
    """Checkpoints for a custom loop. Under torch.distributed, construct it on every rank after
    ``init_process_group`` (it creates one gloo group for its barriers); alone, it needs nothing."""

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
    ) -> None:
        """
        url: a local path or any fsspec URL (``s3://bucket/prefix``).
        every_steps / every_seconds: the schedule :meth:`step` follows (either, both or neither).
        keep_last, keep_every_steps: retention, as ``--keep-last`` / ``--keep-every-steps``.
        async_save: scheduled checkpoints persist on a background thread of rank 0.
        on_storage_failure: ``warn`` skips a scheduled checkpoint storage refused past the retry
            deadline; ``fail`` raises on every rank.
        timeout_s: budget for the barriers around resume and saves.
        map_location: where resumed tensors go; default the device of the model's first parameter.
        event_log: rank 0 appends start, resume, checkpoint, preempted and end events (JSON
            lines) to this local file, and any rank its last words; ``python -m elastictrain
            report`` draws it as it draws the runner's.
        preempt_signals: signals that mean "checkpoint this step and stop" (see :class:`Preempted`);
            ``()`` leaves the process's signal handlers alone. :meth:`close` restores them.
        hang_timeout: seconds between two :meth:`step` calls after which this rank is hung: it
            dumps every thread's Python stack and exits 4, so torchrun restarts the group instead
            of every rank waiting out the process group's timeout. Before the first step, and
            during resume and saves, ``timeout_s`` applies instead. Off (None) by default, since
            it ends the process. Under torchrun it also exits (6) when the agent is gone.
        """
        for name, value in (("every_steps", every_steps), ("keep_every_steps", keep_every_steps)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(
                    f"CheckpointManager({name}={value!r}): use a positive int or None."
                )
        if every_seconds is not None and every_seconds <= 0:
            raise ConfigError(f"CheckpointManager(every_seconds={every_seconds!r}): must be > 0.")
        if hang_timeout is not None and hang_timeout <= 0:
            raise ConfigError(f"CheckpointManager(hang_timeout={hang_timeout!r}): must be > 0.")
        if keep_last < 1:
            raise ConfigError(f"CheckpointManager(keep_last={keep_last!r}): keep at least 1.")
        if on_storage_failure not in ("warn", "fail"):
            raise ConfigError(
                f"CheckpointManager(on_storage_failure={on_storage_failure!r}): 'warn' or 'fail'."
            )
        self.alone = not (dist.is_available() and dist.is_initialized())
        self.rank = 0 if self.alone else dist.get_rank()
        world_size = 1 if self.alone else dist.get_world_size()
        self._group = (
            None
            if self.alone
            else dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        )
        self.map_location = map_location
        self._ckpt = Checkpointer(
            url=url,
            storage_options=dict(storage_options or {}),
            retry_deadline=storage_retry_deadline,
            rank=self.rank,
            world_size=world_size,
            generation=time.time_ns(),  # claim() lifts it above every earlier writer's
            control=self._group,
            device=torch.device("cpu"),  # replaced in resume()
            events=EventLog(event_log, enabled=self.rank == 0),
            keep_last=keep_last,
            keep_every=keep_every_steps,
            on_failure=on_storage_failure,
            async_persist=async_save,
        )
        self._schedule = CheckpointSchedule(every_steps, every_seconds)
        self._control = Control(
            torch.device("cpu"), is_rank0=self.rank == 0, group=self._group, alone=self.alone
        )
        self._signals: StopSignals | None = None
        if preempt_signals:
            parsed = [parse_signal(name) for name in preempt_signals]
            if threading.current_thread() is threading.main_thread():
                self._signals = StopSignals(parsed)
            else:  # Python only lets the main thread install signal handlers
                logger.warning(
                    "CheckpointManager built outside the main thread: %s will not checkpoint "
                    "before stopping; build it in the main thread, or pass preempt_signals=()",
                    "/".join(sig.name for sig in parsed),
                )
        self._events = self._ckpt.events
        self._timeout_s = timeout_s
        self._watchdog: HangWatchdog | None = None
        if hang_timeout is not None:
            under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ  # our parent is the agent
            self._watchdog = HangWatchdog(
                hang_timeout,
                startup_s=timeout_s,
                agent_pid=os.getppid() if under_torchrun else None,
                budget_names=("hang_timeout", "timeout_s"),
            ).start()
            # Any rank's last words, so the run report can tell a hang from a kill.
            self._watchdog.last_words = LastWords(event_log, self.rank)
        self._resumed = False
        self.extra: dict[str, Any] | None = None
        """The ``extra`` dict saved with the checkpoint :meth:`resume` loaded, else None."""

    @property
    def last_committed(self) -> int | None:
        """The newest step resumed from or committed (rank 0 also counts background commits)."""
        return self._ckpt.last_committed

    def resume(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None
    ) -> int:
        """Load the newest checkpoint that verifies into ``model``/``optimizer``/``scheduler`` in
        place, on every rank; returns the number of completed steps it holds (0: none yet).

        Always call it once before saving, even on a fresh start: it proves the location is
        writable, and claims it so that a stale writer of an earlier run can never commit again.
        A checkpoint of another model raises ``CheckpointMismatchError`` and changes nothing.
        """
        model = _unwrap(model)
        self._ckpt.device = torch.device(self.map_location or _first_device(model))
        # The same start event as the runner's: `python -m elastictrain report` draws either log.
        self._events.emit(
            "start",
            world_size=self._ckpt.world_size,
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
            restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            generation=self._ckpt.generation,
            host=socket.gethostname(),
        )
        with self._phase("resume"):
            self._ckpt.preflight()
            resumed = self._ckpt.resume(model, optimizer, scheduler, None)
            self._ckpt.claim()
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
        Rank 0's clock, a preemption signal and a failed background persist become everyone's
        decision through one tiny all-reduce every ~0.2 s worth of steps, so every rank must call
        this at every step. Returns True when a checkpoint of ``step`` was taken; raises
        :class:`Preempted` after committing one when a preemption signal arrived.
        """
        if self._watchdog is not None:
            self._watchdog.beat(step)
        decided = self._control.agree(
            step,
            stop=self._signals is not None and self._signals.requested,
            by_time=self.rank == 0 and self._schedule.due_by_time(),
            report=False,
            persist_failed=self._ckpt.failure is not None,
        )
        if decided.persist_failed:
            self._ckpt.raise_failure()
        if decided.stop:
            self._preempted(step, model, optimizer, scheduler, extra)
        if self._schedule.due_by_steps(step) or decided.checkpoint_by_time:
            return self.save(step, model, optimizer, scheduler, extra)
        return False

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
        """Checkpoint ``step`` now, on every rank. ``final=True`` commits before returning (and
        raises if it cannot); otherwise ``async_save`` decides. ``extra``: your own state (tensors
        and plain Python values; loading never unpickles code), back as :attr:`extra` on resume.
        A step that is already committed is not written again. Returns False only when a non-final
        checkpoint was skipped under ``on_storage_failure='warn'``.
        """
        if not self._resumed:
            raise ConfigError(
                "CheckpointManager.save() before resume(): call resume(model, optimizer) once "
                "first; it verifies the location and claims it for this run."
            )
        saved = self._save(step, model, optimizer, scheduler, extra, "final" if final else "steps")
        if final:
            self._events.emit("end", step=step)
        return saved

    def _save(
        self, step: int, model: nn.Module, optimizer: Any, scheduler: Any, extra: Any, reason: str
    ) -> bool:
        with self._phase("checkpoint"):
            saved = self._ckpt.save(
                step=step,
                epoch=0,
                model=_unwrap(model),
                optimizer=optimizer,
                scheduler=scheduler,
                fingerprint=None,
                reason=reason,  # "final" and "preempt" commit before this returns, async or not
                extra=extra,
            )
        self._schedule.mark_saved()
        return saved

    def _phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Storage-bound work is judged by ``timeout_s``, not by the step budget."""
        if self._watchdog is None:
            return contextlib.nullcontext()
        return self._watchdog.phase(name, self._timeout_s)

    def _preempted(
        self, step: int, model: nn.Module, optimizer: Any, scheduler: Any, extra: Any
    ) -> None:
        t0 = time.monotonic()
        self._save(step, model, optimizer, scheduler, extra, "preempt")
        # Without handlers of our own, a peer's signal stopped us: StopSignals([]) says so.
        name = (self._signals or StopSignals([])).announce(self._events, step, t0)
        raise Preempted(step, name)

    def close(self) -> None:
        """Wait for a background persist still in flight; call it before the process exits. Rank 0
        raises if that persist failed for good (nothing else would report it)."""
        if self._signals is not None:
            self._signals.restore()
            self._signals = None
        with self._phase("close"):
            self._ckpt.finish()
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._group is not None and dist.is_initialized():
            # Our gloo group's threads must not outlive the loop: one torn down only at interpreter
            # exit can abort the process ("terminate called without an active exception"), which
            # torchrun counts as a failure and restarts.
            dist.destroy_process_group(self._group)
            self._group = None
        if self._ckpt.failure is not None:
            self._ckpt.raise_failure()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP/FSDP-style wrappers, so keys carry no ``module.`` prefix."""
    return getattr(model, "module", model)


def _first_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")

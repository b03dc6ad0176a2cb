"""One checkpoint session: the sequence both the runner and library mode drive.

    session = CheckpointSession(config, rank=..., world_size=..., ...)
    session.emit_start(...)                      # the run report's "an attempt began"
    resumed = session.resume(state)              # preflight -> resume -> claim, under the gate
    for step in ...:
        ...train...
        session.step(done, state)                # agree -> failure? -> stop? -> scheduled save
    session.save(max_steps, state, Reason.FINAL)
    session.emit_end(step)
    session.close()

Written once, so a fix or a test of one path covers the other: ``runner`` wraps it around the
built-in loop, ``CheckpointManager`` around the user's. Validation of every checkpoint setting
lives in :class:`SessionConfig`, which each path fills with its own spelling of the settings
(``--keep-last`` or ``keep_last``) so errors name what the user typed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from elastictrain import dist as edist
from elastictrain import knobs
from elastictrain.checkpoint.checkpointer import Checkpointer, Resumed
from elastictrain.checkpoint.local_tier import LocalTierConfig
from elastictrain.checkpoint.persist import MUST_COMMIT, Reason
from elastictrain.checkpoint.schedule import CheckpointSchedule
from elastictrain.checkpoint.state import TrainState
from elastictrain.control import Control
from elastictrain.env import read_env
from elastictrain.errors import EXIT_PREEMPTED, ConfigError, named_timeout
from elastictrain.observe.events import Event, EventLog, LastWords
from elastictrain.observe.history import LAST_WORDS_WAIT_S, RunHistory
from elastictrain.signals import StopSignals, parse_signal
from elastictrain.watchdog import HangWatchdog
from storage.hashing import ALGORITHMS, DEFAULT_ALGORITHM, check_algorithm, stop_hasher

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class SessionConfig:
    """Every checkpoint setting, validated here for both paths."""

    url: str
    """Root of the checkpoints: a local path or any fsspec URL."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    every_steps: int | None = None
    """Checkpoint every N completed steps; None or 0: off."""
    every_seconds: float | None = None
    """Also checkpoint T seconds after the last one, on rank 0's clock; None or 0: off."""
    keep_last: int = 3
    keep_every_steps: int | None = None
    async_save: bool = True
    storage_retry_deadline: float = 120.0
    on_storage_failure: str = "warn"
    resume_read: str = "rank0"
    timeout_s: float = 1800.0
    """Budget of the gates around resume and saves (and the watchdog's, during them)."""
    hang_timeout: float | None = None
    preempt_signals: tuple[str, ...] = ("SIGTERM",)
    """Signals that mean "checkpoint this step and stop"; Ctrl-C (SIGINT) always does too.
    Empty: leave every signal handler alone. See :func:`install_stop_signals`."""
    event_log: str | None = None
    checksum: str = DEFAULT_ALGORITHM
    """How new checkpoint files are hashed: xxh3 (fast) or sha256; reads follow each manifest."""
    local_checkpoint: bool = True
    """Keep a local tier: every node's copy of the replicated state on node-local storage."""
    local_checkpoint_dir: str | None = None
    """None: a per-job folder under /dev/shm (off, with one INFO line, when it lacks room)."""
    local_every_steps: int | str = "auto"
    """Local copies every N steps, or "auto": as often as ``local_overhead`` allows, measured."""
    local_overhead: float = 0.02
    """``auto``'s budget: the share of step time the local copies may cost."""
    spelling: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)
    """How the user spells each field (``--keep-last`` for the runner), named in errors."""

    def spell(self, name: str) -> str:
        return self.spelling.get(name, name)

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ConfigError:
            return ConfigError(f"{self.spell(name)} must be {rule}, got {getattr(self, name)!r}.")

        if not self.url:
            raise ConfigError(
                f"{self.spell('url')} must not be empty; e.g. ./checkpoints or s3://bucket/run."
            )
        for name in ("every_steps", "every_seconds"):
            if getattr(self, name) == 0:
                setattr(self, name, None)  # 0 means off, for steps and seconds alike
        for name in ("every_steps", "keep_every_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise bad(name, "a positive whole number (or 0/None: off)")
        for name, optional in (
            ("every_seconds", True),
            ("keep_last", False),
            ("storage_retry_deadline", False),
            ("timeout_s", False),
            ("hang_timeout", True),
        ):
            value = getattr(self, name)
            if not (value is None and optional) and (value is None or value <= 0):
                raise bad(name, "> 0")
        if self.on_storage_failure not in ("warn", "fail"):
            raise bad("on_storage_failure", "'warn' or 'fail'")
        if self.resume_read not in ("rank0", "all"):
            raise bad("resume_read", "'rank0' or 'all'")
        for name in self.preempt_signals:
            parse_signal(name, setting=self.spell("preempt_signals"))
        try:
            check_algorithm(self.checksum)
        except ValueError:
            raise bad("checksum", f"one of {sorted(ALGORITHMS)}") from None
        if isinstance(self.local_every_steps, str) and self.local_every_steps.isdigit():
            self.local_every_steps = int(self.local_every_steps)
        every = self.local_every_steps
        if every != "auto" and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
            raise bad("local_every_steps", "a positive whole number or 'auto'")
        if not 0 < self.local_overhead < 1:
            raise bad("local_overhead", "a fraction of step time between 0 and 1, e.g. 0.02")

    def local_tier(self) -> LocalTierConfig:
        return LocalTierConfig(
            enabled=self.local_checkpoint,
            dir=self.local_checkpoint_dir,
            every_steps=self.local_every_steps,
            overhead=self.local_overhead,
        )


def install_stop_signals(
    config: SessionConfig, early: StopSignals | None = None
) -> StopSignals | None:
    """The handlers for ``config.preempt_signals`` and Ctrl-C, or None when there are none.
    ``early``: handlers installed before the heavy imports, which keep what they caught."""
    parsed = [parse_signal(name) for name in config.preempt_signals]
    if early is not None:
        return early.add(parsed)
    return StopSignals(parsed) if parsed else None


class Preempted(SystemExit):
    """Raised on every rank once a stop signal (SIGTERM, Ctrl-C, ...) has been agreed and the
    checkpoint of that step committed. Exit code 75: relaunch to continue. Catch it to clean up
    first; it is a ``SystemExit``, so ``except Exception`` will not."""

    def __init__(self, step: int, signal_name: str) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.step, self.signal_name = step, signal_name

    def __str__(self) -> str:
        return f"preempted ({self.signal_name}) at step {self.step}: checkpoint committed"


class StepOutcome(NamedTuple):
    report: bool
    """Every rank agreed that a progress report is due (rank 0's clock)."""
    saved: bool
    """A checkpoint of this step was taken (False: none due, or skipped under ``warn``)."""


class CheckpointSession:
    """Checkpoints for one attempt of a job, on every rank."""

    def __init__(
        self,
        config: SessionConfig,
        *,
        rank: int,
        world_size: int,
        generation: int,
        gate: dist.ProcessGroup | None,
        device: torch.device,
        agree_group: dist.ProcessGroup | None = None,
        agree_device: torch.device | None = None,
        watchdog: HangWatchdog | None = None,
        attached: Callable[[], bool] = lambda: True,
        signals: StopSignals | None = None,
    ) -> None:
        """``gate``: a gloo group bounded by ``timeout_s`` for the resume and save barriers (None:
        a single process without torch.distributed). ``agree_group``/``agree_device``: where the
        per-step agreement runs (default: ``gate``, on the CPU; the runner uses the default group
        on the training device). ``attached``: False once the
        torchrun agent is gone, so an orphan never commits. ``signals``: the stop-signal handlers,
        installed by the caller as early as it can (a signal during init is honoured at step 1);
        :meth:`close` puts the previous handlers back."""
        self.config, self.rank = config, rank
        self.is_rank0 = rank == 0
        alone = gate is None
        # The run's history beside its checkpoints (rank 0's events, every rank's last words);
        # the store opens lazily, on the history's own thread.
        self.history = RunHistory(lambda: self.ckpt.open_store(), rank=rank, generation=generation)
        self.events = EventLog(config.event_log, enabled=self.is_rank0, history=self.history)
        self.last_words = LastWords(config.event_log, rank, history=self.history)
        self.watchdog = watchdog
        if watchdog is not None:
            watchdog.last_words = self.last_words
        self.signals = signals
        if signals is not None:
            signals.last_words = self.last_words
        self.ckpt = Checkpointer(
            url=config.url,
            storage_options=dict(config.storage_options),
            retry_deadline=config.storage_retry_deadline,
            rank=rank,
            world_size=world_size,
            generation=generation,
            control=gate,
            device=device,
            events=self.events,
            keep_last=config.keep_last,
            keep_every=config.keep_every_steps,
            read_mode=config.resume_read,
            on_failure=config.on_storage_failure,
            async_persist=config.async_save,
            attached=attached,
            gate_timeout_s=config.timeout_s,
            checksum=config.checksum,
            local=config.local_tier(),
            local_rank=read_env().local_rank,
        )
        self.schedule = CheckpointSchedule(config.every_steps, config.every_seconds)
        self.control = Control(
            agree_device or torch.device("cpu"),
            is_rank0=self.is_rank0,
            interval_s=knobs.control_interval_s(),
            group=agree_group if agree_group is not None else gate,
            alone=alone,
        )
        self._probed = False

    # -- the sequence ----------------------------------------------------------------------------
    @property
    def generation(self) -> int:
        return self.ckpt.generation

    @property
    def last_committed(self) -> int | None:
        return self.ckpt.last_committed

    @property
    def last_local(self) -> int | None:
        """This node's newest local-tier copy, if this rank writes one."""
        return self.ckpt.local.newest if self.ckpt.local is not None else None

    def emit_start(self, **fields: Any) -> None:
        """The ``start`` event that begins an attempt in the run report."""
        self.events.emit(
            Event.START,
            world_size=self.ckpt.world_size,
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
            restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            generation=self.generation,
            host=socket.gethostname(),
            **fields,
        )

    def emit_end(self, step: int, **fields: Any) -> None:
        self.events.emit(Event.END, step=step, **fields)
        self._flush_history()

    def _flush_history(self) -> None:
        """Before the process may exit: rank 0's last events reach the checkpoint location (or
        the wait runs out; the history never holds up an exit for long)."""
        if self.is_rank0:
            self.history.flush(wait_s=LAST_WORDS_WAIT_S)

    def preflight(self) -> None:
        """Rank 0 proves the location usable before any compute is spent, and in a multi-node
        job every node proves it sees the same location (once)."""
        env = read_env()
        with self.gate("resume"):
            self.ckpt.preflight(
                local_rank=env.local_rank,
                local_world_size=env.local_world_size,
                setting=self.config.spell("url"),
            )
        self._probed = True

    def resume(self, state: TrainState) -> Resumed:
        """Load the newest checkpoint that verifies into ``state`` on every rank, then claim the
        location for this generation, fencing out older writers. A checkpoint that does not fit
        raises before anything is claimed or changed."""
        if not self._probed:
            self.preflight()
        with self.gate("resume"):
            resumed = self.ckpt.resume(state)
            self.ckpt.claim()
        return resumed

    def step(
        self, done: int, state: TrainState, *, report: bool = False, may_save: bool = True
    ) -> StepOutcome:
        """After every optimizer step, on every rank: agree on what one rank knows (a stop
        signal, rank 0's clock, a failed background persist), then act on it together. Raises
        :class:`Preempted` after committing ``done`` when a stop was agreed."""
        if self.watchdog is not None:
            self.watchdog.beat(done)
        decided = self.control.agree(
            done,
            stop=self.signals is not None and self.signals.requested,
            by_time=self.is_rank0 and self.schedule.due_by_time(),
            report=report,
            persist_failed=self.ckpt.failure is not None,
            abandoned_step=self.ckpt.skipped_step,
        )
        if decided.persist_failed:
            self.ckpt.raise_failure()
        if decided.abandoned_step is not None:
            self.ckpt.abandon(decided.abandoned_step)
        if decided.stop:
            self.preempt(done, state)
        saved = False
        if may_save and (self.schedule.due_by_steps(done) or decided.checkpoint_by_time):
            reason = Reason.TIME if decided.checkpoint_by_time else Reason.STEPS
            saved = self.save(done, state, reason)
        if may_save and self.ckpt.local is not None:
            self.ckpt.local.after_step(done, state, durable_saved=saved)
        return StepOutcome(report=decided.report, saved=saved)

    def save(self, step: int, state: TrainState, reason: Reason) -> bool:
        """Checkpoint ``step`` on every rank; the final and preemption ones commit before this
        returns. False only when a scheduled one was skipped under ``on_storage_failure=warn``."""
        with self.gate("checkpoint", f"the {reason} checkpoint at step {step}"):
            if state.per_rank:  # every rank is here (the save is agreed): one small all-gather
                state.gather(lambda mine: edist.all_gather_object(mine, self.ckpt.control))
            committed = self.ckpt.save(step, state, reason)
            if committed and reason in MUST_COMMIT and self.ckpt.local is not None:
                # The durable tier holds the newest state now; /dev/shm is memory.
                self.ckpt.local.remove()
        # A skipped checkpoint restarts the clock too: storage that is down is retried at the
        # next scheduled checkpoint, not every step.
        self.schedule.mark_saved()
        return committed

    def preempt(self, step: int, state: TrainState) -> None:
        t0 = time.monotonic()
        self.save(step, state, Reason.PREEMPT)
        # Without handlers of our own, a peer's signal stopped us: StopSignals([]) says so.
        name = (self.signals or StopSignals([], interrupt=False)).announce(self.events, step, t0)
        self._flush_history()
        raise Preempted(step, name)

    def close(self) -> None:
        """Give the signal handlers back and wait for a background persist in flight; raises if
        rank 0's last persist failed for good (nothing else would report it)."""
        if self.signals is not None:
            self.signals.restore()
            self.signals = None
        with self.gate("close"):
            self.ckpt.finish()
        # End every thread this session started (the history's writer, the hash helper): one
        # still alive at interpreter teardown can abort a cleanly finished process.
        if self.is_rank0:
            self.history.close(wait_s=LAST_WORDS_WAIT_S)
        stop_hasher()
        if self.ckpt.failure is not None:
            self.ckpt.raise_failure()

    @contextlib.contextmanager
    def gate(self, phase: str, what: str | None = None) -> Iterator[None]:
        """Storage-bound work: judged by ``timeout_s`` (the watchdog's budget too), and a backend
        timeout becomes an error that names that setting."""
        budget = self.config.timeout_s
        watch = self.watchdog.phase(phase, budget) if self.watchdog else contextlib.nullcontext()
        with watch, named_timeout(self.config.spell("timeout_s"), budget, what or phase):
            yield

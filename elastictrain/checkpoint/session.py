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
built-in loop, ``CheckpointManager`` around the user's. Both hand it one
:class:`~elastictrain.config.CheckpointConfig`, whole.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import storage
from elastictrain import knobs
from elastictrain.checkpoint import rollback
from elastictrain.checkpoint.api import Reason
from elastictrain.checkpoint.checkpointer import Checkpointer, Resumed
from elastictrain.checkpoint.resume.live import Live
from elastictrain.checkpoint.schedule import CheckpointSchedule
from elastictrain.checkpoint.state.train_state import TrainState
from elastictrain.cluster.collectives import all_gather_object
from elastictrain.cluster.env import DistEnv
from elastictrain.config import CheckpointConfig
from elastictrain.errors import Preempted, named_timeout
from elastictrain.observe import goodput
from elastictrain.observe.events import Event, EventLog, LastWords
from elastictrain.observe.history import LAST_WORDS_WAIT_S, RunHistory
from elastictrain.runtime.control import Control
from elastictrain.runtime.signals import StopSignals, parse_signal
from elastictrain.runtime.watchdog import HangWatchdog
from storage.hashing import stop_hasher

logger = logging.getLogger(__name__)


def install_stop_signals(
    config: CheckpointConfig,
    early: StopSignals | None = None,
    last_words: Callable[[str, str], None] | None = None,
) -> StopSignals | None:
    """The handlers for ``config.preempt_signals`` and Ctrl-C, or None when there are none.
    ``early``: handlers installed before the heavy imports, which keep what they caught.
    ``last_words``: where a Ctrl-C abort is recorded."""
    parsed = [parse_signal(name) for name in config.preempt_signals]
    if early is not None:
        return early.add(parsed, last_words)
    if not parsed:
        return None
    if last_words is None:
        return StopSignals(parsed)
    return StopSignals(parsed, last_words=last_words)


class StepOutcome(NamedTuple):
    report: bool
    """Every rank agreed that a progress report is due (rank 0's clock)."""
    saved: bool
    """A checkpoint of this step was taken (False: none due, or skipped under ``warn``)."""
    spike_step: int | None = None
    """The earliest step some rank found a loss spike at (``train.numerics``): no copy of this
    step was taken, and the caller rolls back (:meth:`CheckpointSession.roll_back`)."""


class CheckpointSession:
    """Checkpoints for one attempt of a job, on every rank."""

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        env: DistEnv,
        generation: int,
        gate: dist.ProcessGroup | None,
        agree_group: dist.ProcessGroup | None = None,
        agree_device: torch.device | None = None,
        watchdog: HangWatchdog | None = None,
        attached: Callable[[], bool] = lambda: True,
        signals: StopSignals | None = None,
        last_words: LastWords | None = None,
    ) -> None:
        """``env``: where this process sits (rank, world size, node). ``gate``: a gloo group
        bounded by ``checkpoint_timeout`` for the resume and save barriers (None: a single process
        without torch.distributed). ``agree_group``/``agree_device``: where the per-step
        agreement runs (default: ``gate``, on the CPU; the runner uses the default group on the
        training device). ``watchdog``: the caller's hang watchdog, told about every step and
        gate. ``attached``: False once the torchrun agent is gone, so an orphan never commits.
        ``signals``: the stop-signal handlers, installed by the caller as early as it can (a
        signal during init is honoured at step 1); :meth:`close` puts the previous handlers
        back. ``last_words``: the recorder the caller gave the watchdog, the handlers and
        liveness when it built them (default: a new one); from here it also writes beside the
        checkpoints."""
        self.config, self.env, self.rank = config, env, env.rank
        self.is_rank0 = env.rank == 0
        self._gate = gate
        # The run's history beside its checkpoints (rank 0's events, every rank's last words);
        # the store opens lazily, on the history's own thread.
        self.history = RunHistory(
            lambda: self._ckpt.open_store(), rank=env.rank, generation=generation
        )
        self.events = EventLog(config.event_log, enabled=self.is_rank0, history=self.history)
        self.hosts: list[str] | None = None
        """Rank 0: each rank's host, by rank, from this attempt's ``start`` event."""
        self.nodes: list[int] | None = None
        """Rank 0: each rank's node (torchrun's ``GROUP_RANK``), from the same event."""
        self.store_nodes: list[int] = []
        """Rank 0: the nodes whose torchrun agent serves the job's store."""
        self.last_words = last_words or LastWords(config.event_log, env.rank)
        self.last_words.keep_with(self.history)
        self._watchdog = watchdog
        self._signals = signals
        self._ckpt = Checkpointer(
            config,
            rank=env.rank,
            world_size=env.world_size,
            local_rank=env.local_rank,
            local_world_size=env.local_world_size,
            generation=generation,
            group=gate,
            events=self.events,
            attached=attached,
        )
        self.schedule = CheckpointSchedule(
            config.checkpoint_every_steps, config.checkpoint_every_seconds
        )
        self._agreement = Control(
            agree_device or torch.device("cpu"),
            is_rank0=self.is_rank0,
            interval_s=knobs.control_interval_s(),
            group=agree_group if agree_group is not None else gate,
            alone=gate is None,
        )
        self._probed = False

    # -- the sequence ----------------------------------------------------------------------------
    @property
    def generation(self) -> int:
        return self._ckpt.generation

    @property
    def last_committed(self) -> int | None:
        """The newest durable step resumed from or committed (rank 0 also counts background
        commits)."""
        return self._ckpt.last_committed

    @property
    def last_local(self) -> int | None:
        """This node's newest local-tier copy, if this rank writes one."""
        return self._ckpt.last_local

    def tier_room(self, state: TrainState, step: int) -> tuple[int, int] | None:
        """The node-memory tier's (free, needed) bytes where this rank writes it; None elsewhere
        (the node's self-check, ``cluster.self_check``)."""
        local = self._ckpt.local
        return local.room(state, step) if local is not None else None

    @property
    def skipped_checkpoints(self) -> int:
        """Scheduled checkpoints skipped under ``on_storage_failure="warn"``."""
        return self._ckpt.skipped

    def emit_start(self, store_here: bool = False, **fields: Any) -> None:
        """The ``start`` event that begins an attempt in the run report, every rank together: it
        names each rank's training process (host, pid) and node, gathered on rank 0 alone.
        ``store_here``: this rank's node serves the job's store (``store_nodes``: never evicted)."""
        mine = [socket.gethostname(), os.getpid(), self.env.node_rank, store_here]
        if self._gate is None:
            gathered = [mine]
        else:
            gathered = [None] * self.env.world_size if self.is_rank0 else None
            dist.gather_object(mine, gathered, dst=0, group=self._gate)
        processes = None
        if gathered is not None:
            self.hosts = [host for host, *_ in gathered]
            self.nodes = [node for _, _, node, _ in gathered]
            self.store_nodes = sorted({node for _, _, node, here in gathered if here})
            processes = [[host, pid] for host, pid, *_ in gathered]
        self.events.emit(
            Event.START,
            world_size=self.env.world_size,
            local_world_size=self.env.local_world_size,
            restart_count=self.env.restart_count,
            generation=self.generation,
            host=mine[0],
            processes=processes,
            nodes=self.nodes,
            **({"store_nodes": self.store_nodes} if self.store_nodes else {}),
            **fields,
        )

    def emit_end(self, step: int, **fields: Any) -> None:
        """The run finished: rank 0 says so with the run's goodput, from its whole history."""
        if self.is_rank0:
            fields.update(self._goodput())
        self.events.emit(Event.END, step=step, **fields)
        self._flush_history()

    def _goodput(self) -> dict[str, Any]:
        """Effective training time and lost time by cause (``observe.goodput``), read from the
        history once every earlier line is in it; nothing (and a warning) when it cannot be read:
        the end of a run never fails for its report."""
        try:
            self.history.flush(wait_s=LAST_WORDS_WAIT_S)
            history = self._ckpt.open_store().read_history()
            return goodput.of_run(history, self.config.event_log, time.time()).fields()
        except (storage.StorageError, OSError, ValueError) as e:
            logger.warning("no goodput in the end event: the run's history is unreadable: %s", e)
            return {}

    def _flush_history(self) -> None:
        """Before the process may exit: rank 0's last events reach the checkpoint location (or
        the wait runs out; the history never holds up an exit for long)."""
        if self.is_rank0:
            self.history.flush(wait_s=LAST_WORDS_WAIT_S)

    def preflight(self) -> None:
        """Rank 0 proves the location usable before any compute is spent, and in a multi-node
        job every node proves it sees the same location (once)."""
        with self.gate("resume"):
            self._ckpt.preflight(
                local_world_size=self.env.local_world_size,
                setting=self.config.name_of("checkpoint_dir"),
            )
        self._probed = True

    def resume(self, state: TrainState, device: torch.device, live: Live | None = None) -> Resumed:
        """Load the newest checkpoint that verifies into ``state`` on every rank, its tensors
        mapped to ``device``, then claim the location for this generation, fencing out older
        writers. A checkpoint that does not fit raises before anything is claimed or changed.
        ``live``: an in-place epoch's state, from a survivor's memory (the location was proven
        by the epoch before: no preflight)."""
        if not self._probed and live is None:
            self.preflight()
        with self.gate("resume"):
            resumed = self._ckpt.resume(state, device, live)
            self._ckpt.claim()
        return resumed

    def agrees_at(self, done: int) -> bool:
        """Whether :meth:`step` agrees at ``done`` (its all-reduce runs at intervals)."""
        return self._agreement.due(done)

    def roll_back(self, state: TrainState, device: torch.device, not_after: int):
        """Every rank: ``state`` back to the newest copy at or before ``not_after``, the newer
        ones retracted, a new generation claimed (``checkpoint.rollback``); (Resumed, the
        durable steps retracted)."""
        with self.gate("resume", f"the rollback to step {not_after} or before"):
            resumed, retracted = rollback.roll_back(self._ckpt, state, device, not_after)
        self._agreement.restart_at(resumed.step + 1)
        return resumed, retracted

    def step(
        self,
        done: int,
        state: TrainState,
        *,
        report: bool = False,
        may_save: bool = True,
        spike_step: int | None = None,
    ) -> StepOutcome:
        """After every optimizer step, on every rank: agree on what one rank knows (a stop
        signal, rank 0's clock, a failed background persist), then act on it together. Raises
        :class:`Preempted` after committing ``done`` when a stop was agreed."""
        if self._watchdog is not None:
            self._watchdog.beat(done)
        decided = self._agreement.agree(
            done,
            stop=self._signals is not None and self._signals.requested,
            by_time=self.is_rank0 and self.schedule.due_by_time(),
            report=report,
            persist_failed=self._ckpt.failure_code,
            abandoned_step=self._ckpt.skipped_step,
            spike_step=spike_step,
        )
        if decided.persist_failed:
            self._ckpt.raise_failure(decided.persist_failed)
        if decided.abandoned_step is not None:
            self._ckpt.abandon(decided.abandoned_step)
        if decided.spike_step is not None:  # this state is rolled back: never a copy of it
            return StepOutcome(report=decided.report, saved=False, spike_step=decided.spike_step)
        if decided.stop:
            self.preempt(done, state)
        saved = False
        if may_save and (self.schedule.due_by_steps(done) or decided.checkpoint_by_time):
            reason = Reason.TIME if decided.checkpoint_by_time else Reason.STEPS
            saved = self.save(done, state, reason)
        if may_save:
            self._ckpt.after_step(done, state, durable_saved=saved)
        return StepOutcome(report=decided.report, saved=saved)

    def save(self, step: int, state: TrainState, reason: Reason) -> bool:
        """Checkpoint ``step`` on every rank; the final and preemption ones commit before this
        returns. False only when a scheduled one was skipped under ``on_storage_failure=warn``."""
        with self.gate("checkpoint", f"the {reason} checkpoint at step {step}"):
            if state.per_rank:  # every rank is here (the save is agreed): one small all-gather
                state.gather(lambda mine: all_gather_object(mine, self._gate))
            committed = self._ckpt.save(step, state, reason)
        # A skipped checkpoint restarts the clock too: storage that is down is retried at the
        # next scheduled checkpoint, not every step.
        self.schedule.mark_saved()
        return committed

    def stop_if_told(self, step: int, state: TrainState) -> None:
        """Every rank, before an epoch's first step: a stop signal that came while the epoch
        formed and loaded ends it before it trains (torchrun stopping the group in the middle of
        an in-place recovery: a replacement was seen to form an epoch alone, train a step at
        world size 1 and commit it on the signal). One agreement, as after a step; ``step`` is
        committed first only when it is newer than the durable tier's newest."""
        decided = self._agreement.agree(
            step,
            stop=self._signals is not None and self._signals.requested,
            by_time=False,
            report=False,
            persist_failed=0,
        )
        if decided.stop:
            self.preempt(step, state, save=step > (self.last_committed or 0))

    def preempt(self, step: int, state: TrainState, *, save: bool = True) -> None:
        t0 = time.monotonic()
        if save:
            self.save(step, state, Reason.PREEMPT)
        # Without handlers of our own, a peer's signal stopped us: StopSignals([]) says so.
        name = (self._signals or StopSignals([], interrupt=False)).announce(self.events, step, t0)
        self._flush_history()
        raise Preempted(step, name)

    def close(self) -> None:
        """Give the signal handlers back and wait for a background persist in flight; raises if
        rank 0's last persist failed for good (nothing else would report it)."""
        if self._signals is not None:
            self._signals.restore()
            self._signals = None
        with self.gate("close"):
            self._ckpt.finish()
        # End every thread this session started (the history's writer, the hash helper): one
        # still alive at interpreter teardown can abort a cleanly finished process.
        if self.is_rank0:
            self.history.close(wait_s=LAST_WORDS_WAIT_S)
        stop_hasher()
        if self._ckpt.failure is not None:
            self._ckpt.raise_failure()

    def abandon(self) -> None:
        """A peer's process died (``--replace-in-place``): end this epoch's session without a
        collective. The signal handlers stay for the next epoch's session; a background persist
        in flight goes on and commits, or is fenced off by the next epoch's generation. The
        node-memory tier's copy in flight (a local write, never waiting on a peer) is finished
        and its folder let go, so the next epoch's tier can take it."""
        self._signals = None
        if self._ckpt.local is not None:
            self._ckpt.local.finish()
        if self.is_rank0:
            self.history.close(wait_s=LAST_WORDS_WAIT_S)

    @contextlib.contextmanager
    def gate(self, phase: str, what: str | None = None) -> Iterator[None]:
        """Storage-bound work: judged by ``checkpoint_timeout`` (the watchdog's budget too), and a
        backend timeout becomes an error that names that setting."""
        budget, name = self.config.checkpoint_timeout, self.config.name_of("checkpoint_timeout")
        watch = self._watchdog.phase(phase, budget, name, shared=True) if self._watchdog else None
        watch = watch or _no_watch()
        with watch, named_timeout(name, budget, what or phase):
            yield


_no_watch = contextlib.nullcontext

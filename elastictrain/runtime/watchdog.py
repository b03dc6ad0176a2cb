"""Hang detection, and exit when the torchrun agent is gone.

A hang is "no step progress within the budget": a deadlocked collective, a rank wedged inside one
while its process lives (its heartbeat goes on: ``liveness`` cannot see it), user code stuck in a
loop. The watchdog thread dumps every thread's Python stack (faulthandler) and exits non-zero, so
torchrun restarts the group instead of waiting for gloo's 30-minute default.

The budget learns the job's own step time: after ``WARMUP_STEPS`` timed steps it is
max(--hang-floor, ``STEP_MULTIPLE`` x the slowest of the last ``RECENT_STEPS``), never above
--hang-timeout, so a 0.5 s step job finds a wedged rank in a minute, not ten, and a job whose steps
take 2 minutes still gets 20. Startup (resume, the first step's compilation), evaluation and the
checkpoint gates keep their own budgets (``phase``); the time spent in them is not a step's, and
while a peer is inside one (``excuse``, from the heartbeats: rank 0 waiting for a slow persist)
the ranks waiting for it in a collective are judged by --hang-timeout, not the learned budget.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from elastictrain.errors import EXIT_HUNG, EXIT_ORPHANED
from elastictrain.observe.events import Cause

logger = logging.getLogger(__name__)

WARMUP_STEPS = 5  # steps timed before the budget adapts: the first ones warm caches and allocators
RECENT_STEPS = 50  # the window whose slowest step sets the budget: a few minutes of a fast job
STEP_MULTIPLE = 10  # a live step 10x slower than the slowest recent one is rare; a wedge is not


class HangWatchdog:
    """Exits the process when no step completes within the current phase's budget."""

    def __init__(
        self,
        timeout: float,
        *,
        startup_s: float,
        floor_s: float | None = None,
        poll_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        on_hang: Callable[[str], None] | None = None,
        agent_pid: int | None = None,
        parent_pid: Callable[[], int] = os.getppid,
        budget_names: tuple[str, str] = ("--hang-timeout", "--checkpoint-timeout"),
        last_words: Callable[[str, str], None] = lambda cause, detail: None,
        excuse: Callable[[], str | None] = lambda: None,
    ) -> None:
        """``budget_names``: what the user calls the step budget and the other phases' budget,
        named in the hang message so it says which setting to raise. ``floor_s``: the adaptive
        budget's floor (None: the step budget is ``timeout``, fixed)."""
        self.timeout = timeout
        self.floor_s = floor_s
        self._steps: deque[float] = deque(maxlen=RECENT_STEPS)
        self._after_gate = False
        self._budget_names = budget_names
        self._poll_s = poll_s
        self._clock = clock
        self._on_hang = on_hang or _dump_and_exit
        # torchrun starts workers in their own sessions: when the agent dies alone (OOM killer,
        # kill -9), they are reparented and would keep training and committing as zombie writers.
        self._agent_pid = agent_pid
        self._parent_pid = parent_pid
        self._last = clock()
        self._step: int | None = None
        # Until the first step completes (resume, first-step compilation), the startup budget rules.
        self._phase, self._budget = "startup", startup_s
        self._setting = budget_names[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastictrain-watchdog", daemon=True)
        self.excuse = excuse
        """Why a learned step budget may be overrun now (a peer in a gate, from the heartbeats),
        or None."""
        self.last_words = last_words
        """Called with (cause, detail) just before the process exits: every rank records it, so
        the run report can say why the attempt ended."""

    def start(self, excuse: Callable[[], str | None] | None = None) -> HangWatchdog:
        """``excuse``: given here when it comes from an object built after the watchdog (the
        runner's liveness reads the watchdog's step, and excuses its slow steps)."""
        if excuse is not None:
            self.excuse = excuse
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching and end the thread (it wakes at once): none is left for teardown."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self._poll_s + 1.0)

    def beat(self, step: int) -> None:
        now = self._clock()
        timed = self._phase == "training" and self._step is not None and not self._after_gate
        if timed and step > self._step:
            self._steps.append((now - self._last) / (step - self._step))
        self._after_gate = False
        self._step = step
        self._last = now
        if self._phase == "startup":
            self._phase, self._budget = "training", self.timeout
            self._setting = self._budget_names[0]
        if self._phase == "training":
            self._budget, self._setting = self.step_budget()

    @property
    def step(self) -> int | None:
        """The last completed step (None before the first)."""
        return self._step

    @property
    def phase_name(self) -> str:
        """'startup', 'training', or the phase this rank is in (a checkpoint gate, evaluation)."""
        return self._phase

    def step_budget(self) -> tuple[float, str]:
        """The budget of one step now, and what sets it (named in the hang message)."""
        if self.floor_s is None or len(self._steps) < WARMUP_STEPS:
            return self.timeout, self._budget_names[0]
        slowest = max(self._steps)
        learned = max(self.floor_s, STEP_MULTIPLE * slowest)
        if learned >= self.timeout:
            return self.timeout, self._budget_names[0]
        return learned, (
            f"max(--hang-floor, {STEP_MULTIPLE} x the slowest of the last {len(self._steps)} "
            f"steps, {slowest:.2f}s)"
        )

    @contextlib.contextmanager
    def phase(
        self, name: str, budget: float, setting: str | None = None, *, shared: bool = False
    ) -> Iterator[None]:
        """Run a non-step phase (resume, checkpoint save, a wait for the data loader) under its own
        budget; ``setting`` names the budget in the hang message (default: the second of
        ``budget_names``). ``shared``: every rank is in it together (a checkpoint gate,
        evaluation), so the next step waits for the last to leave it and is not timed."""
        previous = (self._phase, self._budget, self._setting)
        self._phase, self._budget = name, budget
        self._setting = setting or self._budget_names[1]
        self._last = self._clock()
        try:
            yield
        finally:
            (self._phase, self._budget, self._setting), self._last = previous, self._clock()
            if shared:
                self._after_gate = True  # the next step's time includes peers still in it

    def check(self) -> bool:
        """True (and the handler called) on a hang or a dead agent; used by the thread."""
        if self._agent_pid is not None and self._parent_pid() != self._agent_pid:
            self._say(Cause.ORPHANED, f"the torchrun agent (pid {self._agent_pid}) is gone")
            _orphaned_exit(self._agent_pid)
            return True
        idle = self._clock() - self._last
        if idle <= self._budget:
            return False
        if self._phase == "training" and idle <= self.timeout and self.excuse() is not None:
            # A peer is inside a phase of its own budget (rank 0 waiting for a slow persist at a
            # checkpoint gate): this rank waits for it in a collective. Its own watchdog judges
            # it; the learned budget is for steps, and the ceiling still holds.
            return False
        reason = (
            f"no progress for {idle:.1f}s in phase '{self._phase}' after step {self._step} "
            f"(budget {self._budget:.0f}s, from {self._setting})"
        )
        self._say(Cause.HANG, reason)
        self._on_hang(reason)
        return True

    def _say(self, cause: str, detail: str) -> None:
        with contextlib.suppress(Exception):  # last words must never stop the exit
            self.last_words(cause, detail)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            if self.check():
                return


def _orphaned_exit(agent_pid: int) -> None:
    logger.error(
        "ORPHANED: the torchrun agent (pid %d) is gone; exiting %d so this worker cannot keep "
        "training or writing checkpoints",
        agent_pid,
        EXIT_ORPHANED,
    )
    logging.shutdown()
    os._exit(EXIT_ORPHANED)


def _dump_and_exit(reason: str) -> None:
    logger.error(
        "HANG DETECTED: %s; dumping Python stacks and exiting %d so torchrun restarts the group",
        reason,
        EXIT_HUNG,
    )
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    logging.shutdown()
    os._exit(EXIT_HUNG)

"""Stop signals: a preemption (SIGTERM from SLURM or Kubernetes, via torchrun) or Ctrl-C.

The first one only sets a flag; at the next agreed step every rank stops, rank 0 commits that step,
and the run exits 75. Nothing is lost and nothing prints a traceback.

Ctrl-C is the one signal a person sends, so a second stop signal after it aborts at once (exit
130) instead of waiting for the checkpoint. A repeated SIGTERM does not: schedulers and launchers
deliver duplicates (SLURM signals every process of the step, and torchrun forwards its own copy),
and those must never cost the preemption checkpoint. Through torchrun, the agent turns a second
Ctrl-C into a SIGTERM for its workers, which is why "any signal after a SIGINT" is the rule.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence

from elastictrain.errors import EXIT_PREEMPTED, ConfigError
from elastictrain.observe.events import Cause, Event, EventLog

logger = logging.getLogger(__name__)

INTERRUPT = signal.SIGINT
EXIT_ABORTED = 128 + signal.SIGINT  # the shell's code for a process ended by Ctrl-C


def parse_signal(name: str, *, setting: str = "--preempt-signal") -> signal.Signals:
    key = name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"
    try:
        return signal.Signals[key]
    except KeyError:
        raise ConfigError(
            f"{setting} {name!r} is not a signal name; use e.g. SIGTERM or SIGUSR1."
        ) from None


class StopSignals:
    """Turns stop signals into a flag. The handler does no I/O and takes no lock, except for the
    abort after a Ctrl-C, which writes one line with a raw ``os.write`` and exits."""

    def __init__(
        self,
        signals: Sequence[signal.Signals],
        *,
        interrupt: bool = True,
        last_words: Callable[[str, str], None] = lambda cause, detail: None,
    ) -> None:
        """``interrupt``: also stop gracefully on SIGINT (Ctrl-C) instead of raising
        KeyboardInterrupt. ``last_words`` records an abort for the run report."""
        self.received: signal.Signals | None = None
        self.received_at: float | None = None
        self.last_words = last_words
        handled = dict.fromkeys([*signals, *([INTERRUPT] if interrupt else [])])
        self._previous = {sig: signal.signal(sig, self._handle) for sig in handled}

    def add(
        self,
        signals: Sequence[signal.Signals],
        last_words: Callable[[str, str], None] | None = None,
    ) -> StopSignals:
        """Handle more signals (the configured ones, once the flags are parsed); ``last_words``:
        where an abort is recorded, once the run knows (these handlers came before it)."""
        if last_words is not None:
            self.last_words = last_words
        for sig in signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Put back the handlers that were there before (library mode hands the process back)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
            self.received_at = time.monotonic()
        elif self.received == INTERRUPT:
            self._abort(signal.Signals(signum))

    def _abort(self, second: signal.Signals) -> None:
        line = (
            f"ABORTED: {second.name} after Ctrl-C; exiting {EXIT_ABORTED} now without the "
            "checkpoint of this step (the last committed checkpoint is kept).\n"
        )
        os.write(2, line.encode())
        try:
            self.last_words(Cause.ABORTED, line.strip())
        finally:
            os._exit(EXIT_ABORTED)

    @property
    def requested(self) -> bool:
        return self.received is not None

    def announce(self, events: EventLog, step: int, save_started: float) -> str:
        """Log and record that the preemption checkpoint of ``step`` is committed; the runner and
        library mode say it the same way. Returns the signal's name."""
        name = self.received.name if self.received else "a peer's signal"
        now = time.monotonic()
        logger.warning(
            "PREEMPTED (%s) at step %d: checkpoint committed in %.2fs; exit %d. Relaunch to continue "
            "from step %d.",
            name,
            step,
            now - save_started,
            EXIT_PREEMPTED,
            step,
        )
        events.emit(
            Event.PREEMPTED,
            step=step,
            signal=name,
            save_s=round(now - save_started, 4),
            signal_to_commit_s=None
            if self.received_at is None
            else round(now - self.received_at, 4),
        )
        return name


def exit_without_teardown(code: int) -> None:
    """Exit without interpreter finalization once everything is committed, flushed and shut down.

    torch 2.13 with gloo can still abort a process in interpreter teardown after a clean finish
    ("terminate called without an active exception", SIGABRT), which torchrun counts as a failure
    and restarts: seen in an FSDP worker that had destroyed its process groups and held no thread
    of ours (1 in one suite run), after the threads elastictrain itself starts were all ended
    (``CheckpointSession.close``). The runner's process is its own, so it skips that teardown.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

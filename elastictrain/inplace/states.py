"""The states of a membership epoch, and every transition between them, written once.

An epoch is one agreed set of training processes. This process goes through these states, the
runner and library mode alike (``driver.EpochDriver`` moves it)::

    spare ─go─> gathering ─members─> forming ─groups─> agreeing ─agreed─> resuming ─state─> training
      │             │ ^                 │                  │                 │                 │
      v             v │                 v                  v                 v                 v
    done          exit└─counted back─ leaving <────────── (a peer lost) ──────────────── leaving|done|exit
                                        │
                                        v
                                       exit

======== ============================================================================================
state    what this process does in it
======== ============================================================================================
spare    imported and built, waits to stand in for a rank whose process dies (``supervisor``)
gathering finds the epoch's members in the job's store: everyone at a start; whoever is back
         after a death (``members.next_members``)
forming  builds the epoch's process groups (the restart-safe handshake), its liveness, its end's
         watch; rank 0 publishes the members for a replacement to read
agreeing agrees with every member how the epoch began (``agreement.agree``): who was replaced, who
         holds the newest step; a failure that recurs ends it here
resuming loads the state: from the survivor holding the newest step, or from the checkpoints
training trains until the run ends or a peer is lost
leaving  a peer was lost: this rank fails the epoch's collectives, counts itself back for the next
         epoch and tears this one's groups down, keeping its state (``members.LiveState``)
done     the run finished (or a spare's wait was ended): exit 0
exit     the process ends with an error or an exit code (the ``reason`` says which)
======== ============================================================================================

Each transition is recorded with its reason and the time spent in the state it leaves
(:class:`Transition`), and becomes one ``epoch_state`` event in the run's event log.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from elastictrain.observe.events import Name


class EpochState(Name):
    SPARE = "spare"
    GATHERING = "gathering"
    FORMING = "forming"
    AGREEING = "agreeing"
    RESUMING = "resuming"
    TRAINING = "training"
    LEAVING = "leaving"
    DONE = "done"
    EXIT = "exit"


S = EpochState
TRANSITIONS: dict[EpochState, frozenset[EpochState]] = {
    S.SPARE: frozenset({S.GATHERING, S.DONE}),
    S.GATHERING: frozenset({S.FORMING, S.EXIT}),
    S.FORMING: frozenset({S.AGREEING, S.EXIT}),
    S.AGREEING: frozenset({S.RESUMING, S.EXIT}),
    S.RESUMING: frozenset({S.TRAINING, S.EXIT}),
    S.TRAINING: frozenset({S.LEAVING, S.DONE, S.EXIT}),
    S.LEAVING: frozenset({S.GATHERING, S.EXIT}),
    S.DONE: frozenset(),
    S.EXIT: frozenset(),
}
"""Every allowed transition. Anything else is a bug of the driver, never a fault of the job."""

FINAL = frozenset({S.DONE, S.EXIT})


class TransitionError(RuntimeError):
    """A transition :data:`TRANSITIONS` does not allow: a bug in the driver."""


@dataclass(frozen=True)
class Transition:
    previous: EpochState | None
    state: EpochState
    reason: str
    at: float
    """Wall-clock time it happened (``time.time()``: comparable across hosts, as events are)."""
    duration_s: float
    """Time spent in ``previous``."""
    step: int | None = None
    """The newest completed step this rank holds, where it has one."""

    def fields(self) -> dict:
        """The ``epoch_state`` event's fields."""
        return {
            "time": self.at,
            "state": self.state,
            "previous": self.previous,
            "reason": self.reason,
            "duration_s": round(self.duration_s, 4),
            **({"step": self.step} if self.step is not None else {}),
        }


class EpochStates:
    """This process's epoch state. Every change is checked against :data:`TRANSITIONS` and handed
    to ``record``; :attr:`history` keeps them all (a process lives through few epochs)."""

    def __init__(
        self,
        initial: EpochState,
        *,
        record: Callable[[Transition], None] = lambda t: None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._record, self._clock, self._wall = record, clock, wall
        self._lock = threading.Lock()  # liveness's thread may read the state while it changes
        self._state, self._since = initial, clock()
        self.history: list[Transition] = [Transition(None, initial, "began", wall(), 0.0)]

    @property
    def state(self) -> EpochState:
        return self._state

    def to(self, state: EpochState, reason: str, *, step: int | None = None) -> Transition:
        with self._lock:
            if state not in TRANSITIONS[self._state]:
                raise TransitionError(f"epoch state {self._state} -> {state} ({reason})")
            now = self._clock()
            t = Transition(self._state, state, reason, self._wall(), now - self._since, step)
            self._state, self._since = state, now
            self.history.append(t)
        self._record(t)
        return t

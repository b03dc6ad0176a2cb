"""Goodput from a run's event history: the share of wall time spent in steps that count, and
where the rest went, by cause.

From the attempts ``timeline`` builds (each ``start`` event begins one):

- **start-up**: an attempt's start event to its first completed step (process groups, the model,
  the resume's load, the first step's own warm-up);
- **detection**: a failed attempt's last step event to the first last words a rank left (a
  SIGKILLed process says nothing, so this is what the survivors saw; none when no rank spoke);
- **restart**: from there to the next attempt's start event (torchrun stopping and respawning the
  workers, Python and torch imports, the rendezvous);
- **replacement**: an in-place epoch (``--replace-in-place``), from the last survivor seeing the
  failure to the epoch's start event (the members agreed, the new process groups); its detection
  is its own record's (``detected_s``), and its start-up includes the state from a survivor;
- **redone steps**: steps the next attempt trained again (from its resume step to the highest step
  the failed one reported), at the failed attempt's own step time;
- **rolled back**: a rollback in place (``train.numerics``: a loss spike, a fault that did not
  clear): the steps it undid, at the attempt's step time, and its own seconds;
- **checkpoint blocking**: the training time each committed checkpoint held the loop
  (``blocked_s``);
- **stragglers**: while a rank is a named straggler (from the report its streak of slow reports
  began at to the one it recovered at, or its attempt's end: an eviction ends it), the steps of
  each report's interval times its median work before the step's first sync over the others'
  median: every synchronous rank waited that long on it each step.

What is left of the wall time is time in steps that count. Step events are periodic, so the
highest step an attempt reported is a lower bound of what it trained: redone steps are a lower
bound too, and detection an upper one. Each cause is a duration in the history, never a model.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field

from elastictrain.observe.history import merge_lines
from elastictrain.observe.timeline import Attempt, Timeline, build_timeline

CAUSES = (
    "start-up",
    "detection",
    "replacement",
    "restart",
    "redone steps",
    "rolled back",
    "checkpoint blocking",
    "stragglers",
)


@dataclass(frozen=True)
class Goodput:
    wall_s: float
    lost_s: dict[str, float] = field(default_factory=dict)
    """Seconds lost, by cause (``CAUSES``)."""

    @property
    def productive_s(self) -> float:
        return max(0.0, self.wall_s - sum(self.lost_s.values()))

    @property
    def ratio(self) -> float:
        """Effective training time: time in steps that count over wall time."""
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def fields(self) -> dict[str, float | dict[str, float]]:
        """For the ``end`` event."""
        return {
            "effective_training_ratio": round(self.ratio, 4),
            "wall_s": round(self.wall_s, 3),
            "lost_s": {cause: round(s, 3) for cause, s in self.lost_s.items()},
        }

    def line(self) -> str:
        lost = ", ".join(f"{cause} {s:.1f}s" for cause, s in self.lost_s.items() if s > 0)
        return (
            f"effective training time {self.ratio:.1%} of {self.wall_s:.1f}s wall"
            f"{'; lost: ' + lost if lost else ''}"
        )


def goodput(timeline: Timeline, until: float | None = None) -> Goodput:
    """The run's goodput from its first start to ``until`` (default: its last event)."""
    attempts = timeline.attempts
    if not attempts:
        return Goodput(0.0, dict.fromkeys(CAUSES, 0.0))
    end = until if until is not None else max(a.end or a.start for a in attempts)
    lost = dict.fromkeys(CAUSES, 0.0)
    for a in attempts:
        if a.trained_at is not None:
            lost["start-up"] += a.trained_at - a.start
        lost["checkpoint blocking"] += sum(float(c.get("blocked_s") or 0) for c in a.checkpoints)
        lost["stragglers"] += _straggler_s(a)
        for r in a.rollbacks:
            undone = max(0, int(r.get("at_step") or 0) - int(r.get("step") or 0))
            lost["rolled back"] += undone * _step_s(a) + float(r.get("seconds") or 0.0)
    for a, nxt in timeline.restarts:
        redone = a.last_step - nxt.resumed_step if nxt.resumed else 0
        lost["redone steps"] += max(0, redone) * _step_s(a)
        if nxt.in_place is not None and nxt.in_place.get("failed_at"):
            # The epoch's own record: when the death was first seen, and by the last survivor.
            failed, detected = float(nxt.in_place["failed_at"]), nxt.in_place.get("detected_s")
            lost["detection"] += max(0.0, detected or 0.0)
            lost["replacement"] += max(0.0, nxt.start - failed - (detected or 0.0))
            continue
        last_step_at = a.points[-1][0] if a.points else a.start
        spoke = [float(w["time"]) for w in a.last_words.values() if "time" in w]
        seen = min([t for t in spoke if t >= last_step_at], default=last_step_at)
        lost["detection"] += max(0.0, seen - last_step_at)
        lost["restart"] += max(0.0, nxt.start - seen)
    return Goodput(max(0.0, end - attempts[0].start), lost)


def of_run(history: list[tuple[str, bytes]], local_log: str | None, until: float) -> Goodput:
    """The goodput of the run so far: its history beside the checkpoints (every attempt's events,
    as rank 0 mirrored them) and this host's event log, if any, merged; for the ``end`` event."""
    texts = [data.decode(errors="replace") for _, data in history]
    if local_log and os.path.isfile(local_log):
        with open(local_log, errors="replace") as f:
            texts.append(f.read())
    return goodput(build_timeline(merge_lines(texts)), until)


def _step_s(a: Attempt) -> float:
    """The attempt's median seconds a step, between its step events from its first completed
    step on (the resume's load and the first step's warm-up are start-up); 0 without two."""
    trained = [(t, s) for t, s in a.points if a.trained_at is not None and t >= a.trained_at]
    rates = [
        (t1 - t0) / (s1 - s0)
        for (t0, s0), (t1, s1) in zip(trained, trained[1:], strict=False)
        if s1 > s0 and t1 > t0
    ]
    return statistics.median(rates) if rates else 0.0


def _straggler_s(a: Attempt) -> float:
    """Seconds every rank of ``a`` waited on its named stragglers (the module's doc)."""
    steps = [step for step, _ in a.work]
    lost = 0.0
    for named in (e for e in a.stragglers if e.get("slow") and e.get("step") in steps):
        rank, at = int(named["rank"]), steps.index(named["step"])
        first = max(0, at - int(named.get("reports") or 1) + 1)
        recovered = [
            steps.index(e["step"])
            for e in a.stragglers
            if e.get("rank") == rank and not e.get("slow") and e.get("step") in steps[at + 1 :]
        ]
        last = recovered[0] - 1 if recovered else len(steps) - 1
        for k in range(first, last + 1):
            medians = a.work[k][1]
            others = [m for r, m in enumerate(medians) if r != rank]
            if rank >= len(medians) or not others:
                continue
            since = steps[k - 1] if k > 0 else a.resumed_step
            lost += max(0.0, medians[rank] - statistics.median(others)) * max(0, steps[k] - since)
    return lost

"""A run's life from its event log: attempts (each ``start`` event begins one), why each ended,
what it trained and checkpointed. Needs nothing beyond the standard library, so the summary works
(and is tested) without the ``[report]`` extra; ``report_plot`` draws it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastictrain.checkpoint.api import Tier
from elastictrain.observe.events import Cause, Event, Name


class Outcome(Name):
    """Why an attempt ended, from its last words (the events written before it went away)."""

    FINISHED = "finished"
    PREEMPTION = "preemption"
    HANG = "hang"
    SILENT = "silent peer"
    MEMBERSHIP = "membership change"
    KILL = "kill"
    LOST = "process lost, recovered in place"  # --replace-in-place: the others kept training
    RUNNING = "running or killed"
    STOPPED = "stopped"


@dataclass
class Attempt:
    index: int
    start: float
    world_size: int
    restart_count: int
    generation: int
    local_world_size: int | None = None
    """Ranks on rank 0's node: the ones whose last words reach this event log."""
    resumed: bool = False
    """False when the attempt ended before its resume completed (killed during startup)."""
    resumed_step: int = 0
    """The step it resumed from; for one that never resumed, the step the run had reached."""
    resumed_from: str = ""
    """Which copy served the resume: "local tier (rank 1), +5 steps" or "durable tier"."""
    end: float | None = None
    """Time of the attempt's last event."""
    trained_at: float | None = None
    """Time its first step completed: the end of the downtime a restart costs."""
    left_at: float | None = None
    """In place: when rank 0 left the epoch (its ``leaving`` transition): where the downtime
    of the next epoch begins, not at the last periodic event before it."""
    outcome: Outcome = Outcome.RUNNING
    detail: str = ""
    points: list[tuple[float, int]] = field(default_factory=list)
    """(time, completed steps) from every event that names a step."""
    losses: list[tuple[int, float]] = field(default_factory=list)
    evals: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    """(step, metrics) of each ``eval`` event."""
    overflow_skips: int = 0
    """Optimizer steps fp16's GradScaler skipped (an overflow), from the progress events."""
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    skipped_steps: list[dict[str, Any]] = field(default_factory=list)
    """The ``skip`` events: a step no rank applied (a non-finite gradient, ``--skip-steps``)."""
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    """The ``rollback`` events: every rank back at an earlier copy, in the same processes."""
    last_words: dict[int, dict[str, Any]] = field(default_factory=dict)
    """The ``exit`` event of each rank that left one, by rank."""
    scores: list[tuple[float, list[float]]] = field(default_factory=list)
    """(time, each rank's straggler score) from the periodic ``stragglers`` events."""
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    """The ``straggler`` events: a rank named persistently slow, or no longer slow."""
    work: list[tuple[int, list[float]]] = field(default_factory=list)
    """(step, each rank's median work before the step's first sync) from the ``stragglers``
    events: what a straggler cost every rank (``goodput``)."""
    evictions: list[dict[str, Any]] = field(default_factory=list)
    """The ``eviction`` events that took a node out (``evicted``): the next epoch began by one."""
    left_out: list[dict[str, Any]] = field(default_factory=list)
    """The ``self_check`` events that left a node out: the next epoch began without it."""
    processes: list[list[Any]] | None = None
    """Each rank's training process, [host, pid], from the ``start`` event."""
    began: str = "fresh start"
    """How this membership epoch began: a fresh start, a restart through torchrun, a relaunch
    (a new torchrun, a scheduler's requeue), a shrink or growth of the world size, or in place
    (``--replace-in-place``: a replacement, a lost node dropped)."""
    in_place: dict[str, Any] | None = None
    """An in-place epoch's start fields: began, replaced_ranks, dropped_ranks (torchrun ranks),
    failed_at (the earliest sign of the death), detected_s."""

    @property
    def stall_s(self) -> float | None:
        """An in-place epoch: from the failure to its first completed step (what the survivors
        stood still)."""
        if self.in_place is None or self.trained_at is None or not self.in_place.get("failed_at"):
            return None
        return self.trained_at - float(self.in_place["failed_at"])

    @property
    def down_from(self) -> float | None:
        """Where the downtime after this attempt begins: its leaving (in place), else its last
        event."""
        return self.left_at if self.left_at is not None else self.end

    @property
    def last_step(self) -> int:
        return max((s for _, s in self.points), default=self.resumed_step)


@dataclass
class Timeline:
    attempts: list[Attempt]
    t0: float
    max_steps: int | None

    @property
    def restarts(self) -> list[tuple[Attempt, Attempt]]:
        return list(zip(self.attempts, self.attempts[1:], strict=False))


def build_timeline(events: list[dict[str, Any]]) -> Timeline:
    """Group events into attempts and classify how each one ended."""
    attempts: list[Attempt] = []
    max_steps = None
    for e in sorted(events, key=lambda e: e.get("time", 0.0)):
        if e.get("event") == Event.START:
            attempts.append(_attempt(e, len(attempts), attempts[-1] if attempts else None))
            max_steps = e.get("max_steps", max_steps)
        elif attempts:  # events before any start (a truncated log): nothing to hang them on
            _add(attempts[-1], e)
    for a in attempts:
        _name_the_silent(a)
    for a, nxt in zip(attempts, attempts[1:], strict=False):
        _classify_end(a, nxt)
    return Timeline(attempts, attempts[0].start if attempts else 0.0, max_steps)


def _attempt(start: dict[str, Any], index: int, before: Attempt | None) -> Attempt:
    return Attempt(
        index=index,
        start=float(start.get("time", 0.0)),
        world_size=int(start.get("world_size", 0)),
        local_world_size=start.get("local_world_size"),
        resumed_step=before.last_step if before else 0,
        restart_count=int(start.get("restart_count", 0)),
        generation=int(start.get("generation", 0)),
        processes=start.get("processes"),
        in_place=_in_place_fields(start),
    )


_STEP_POINTS = (Event.FIRST_STEP, Event.PROGRESS, Event.CHECKPOINT, Event.END)


def _add(a: Attempt, e: dict[str, Any]) -> None:
    """One event of attempt ``a``: where it was, what it trained, how it ended."""
    kind, t, step = e.get("event"), float(e.get("time", 0.0)), e.get("step")
    if kind == Event.EPOCH_STATE:
        # The epoch's own transitions: only its leaving ends what it trained. The next epoch's
        # first transitions (written once its log exists) come before its start.
        if e.get("state") == "leaving" and a.left_at is None:
            a.left_at, a.end = t, t
            if isinstance(step, int):
                a.points.append((t, step))
        return
    a.end = t
    if kind == Event.RESUME and a.resumed:  # a rollback's load, in the same attempt
        a.points.append((t, int(step or 0)))
    elif kind == Event.RESUME:
        a.resumed, a.resumed_step = True, int(step or 0)
        a.resumed_from = _resumed_from(e)
        a.points.append((t, a.resumed_step))
    elif isinstance(step, int) and kind in _STEP_POINTS:
        a.points.append((t, step))
    if kind == Event.FIRST_STEP:
        a.trained_at = t
    _add_record(a, kind, t, e)


def _add_record(a: Attempt, kind: str | None, t: float, e: dict[str, Any]) -> None:
    """What the event records for the report (a loss, a checkpoint, scores), or how it ended."""
    step = e.get("step")
    if kind in (Event.PROGRESS, Event.FIRST_STEP) and e.get("loss") is not None:
        a.losses.append((step, float(e["loss"])))
        a.overflow_skips += int(e.get("overflow_skips", 0))
    elif kind == Event.EVAL:
        a.evals.append((step, dict(e.get("metrics", {}))))
    elif kind == Event.CHECKPOINT:
        a.checkpoints.append(e)
    elif kind in (Event.CHECKPOINT_SKIPPED, Event.SKIP, Event.ROLLBACK):
        kept = {Event.CHECKPOINT_SKIPPED: a.skipped, Event.SKIP: a.skipped_steps}
        kept.get(kind, a.rollbacks).append(e)
    elif kind == Event.STRAGGLERS:
        ranks = e.get("ranks", [])
        if ranks and all("score" in r for r in ranks):  # logs before issue 46 have none
            a.scores.append((t, [float(r["score"]) for r in ranks]))
        if ranks and isinstance(step, int) and all("median_s" in r for r in ranks):
            a.work.append((step, [float(r["median_s"]) for r in ranks]))
    elif kind in (Event.STRAGGLER, Event.EVICTION, Event.SELF_CHECK):
        _add_decision(a, kind, e)
    else:
        _add_ending(a, kind, e)


def _add_decision(a: Attempt, kind: str, e: dict[str, Any]) -> None:
    """Who is in the job: a straggler named, a node evicted or left out by its self-check."""
    if kind == Event.STRAGGLER:
        a.stragglers.append(e)
    elif kind == Event.EVICTION and e.get("evicted"):
        a.evictions.append(e)
    elif kind == Event.SELF_CHECK and e.get("action") != "stop":
        a.left_out.append(e)


def _add_ending(a: Attempt, kind: str | None, e: dict[str, Any]) -> None:
    step = e.get("step")
    if kind == Event.END:
        a.outcome, a.detail = Outcome.FINISHED, f"step {step}"
    elif kind == Event.PREEMPTED:
        a.outcome, a.detail = Outcome.PREEMPTION, f"{e.get('signal')} at step {step}"
    elif kind == Event.EXIT:
        a.last_words[int(e.get("rank", 0))] = e
        if a.outcome not in (Outcome.HANG, Outcome.SILENT):
            # Every rank may leave last words; a hang or a silent peer seen by anyone explains
            # the others' errors.
            a.outcome = _exit_cause(e)
            a.detail = f"rank {e.get('rank', 0)}: {_gist(str(e.get('detail', '')))}"


def _name_the_silent(a: Attempt) -> None:
    """A SIGKILLed rank says nothing; its peers only see the connection drop. Name the silent
    ones (on rank 0's node, whose last words reach this log) as the likely victims."""
    if a.outcome != Outcome.KILL or not a.local_world_size:
        return
    silent = sorted(set(range(a.local_world_size)) - set(a.last_words))
    if silent:
        who = f"rank{'s' * (len(silent) > 1)} {', '.join(map(str, silent))}"
        a.detail = f"{who} died without a word; {a.detail}"


def _classify_end(a: Attempt, nxt: Attempt) -> None:
    """How ``a`` ended, given how the attempt after it began."""
    nxt.began = _began(a, nxt)
    if nxt.in_place is not None and a.outcome == Outcome.RUNNING:
        # The others kept their processes: one died (or a node did), the epoch went on.
        a.outcome, a.detail = Outcome.LOST, nxt.began
    elif nxt.world_size != a.world_size:
        # A node left or joined: the agents re-rendezvoused at another size. Whatever rank 0
        # saw (SIGTERM from its agent, a dead peer) was the symptom of that.
        a.detail = f"world size {a.world_size} -> {nxt.world_size}; {a.outcome} {a.detail}"
        a.outcome = Outcome.MEMBERSHIP
    elif a.outcome == Outcome.RUNNING:
        # Rank 0 wrote nothing about its end: it, or a peer, was killed outright.
        a.outcome, a.detail = (
            Outcome.KILL,
            "a worker or node died without a word (SIGKILL, OOM, crash)",
        )


def _in_place_fields(start: dict[str, Any]) -> dict[str, Any] | None:
    keys = ("began", "replaced_ranks", "dropped_ranks", "failed_at", "detected_s")
    return {k: start.get(k) for k in keys} if start.get("began") else None


def _began(before: Attempt, a: Attempt) -> str:
    # A node taken out on purpose (a straggler's, a replica's that computed wrong, one that
    # failed its self-check) is not a failure: said apart.
    why = ""
    if before.evictions:
        wrong = str(before.evictions[-1].get("cause", "")).startswith("computed wrong")
        why = "a node that computed wrong evicted, " if wrong else "a straggler's node evicted, "
    why += "a node that failed its self-check left out, " if before.left_out else ""
    if a.in_place is not None:
        ranks = a.in_place.get("replaced_ranks") or a.in_place.get("dropped_ranks") or []
        size = (
            f", {before.world_size} -> {a.world_size}" if a.world_size != before.world_size else ""
        )
        return f"{why}{a.in_place['began']}: rank {', '.join(map(str, ranks))}{size}"
    if a.world_size != before.world_size:
        grew = "grown" if a.world_size > before.world_size else "shrunk"
        return f"{why}{grew} {before.world_size} -> {a.world_size}"
    if a.restart_count > before.restart_count:
        return f"{why}restart through torchrun"
    return "relaunch"  # torchrun's restart count began again: a new torchrun


def _gist(message: str) -> str:
    """The part of an error a person needs: gloo's messages start with its source location and end
    with generic advice."""
    if message.startswith("[") and "] " in message:
        message = message.split("] ", 1)[1]
    return message.split(". This is typically", 1)[0][:160]


def _exit_cause(e: dict[str, Any]) -> str:
    cause = e.get("cause", "")
    if cause == Cause.PEER_SILENT:
        return Outcome.SILENT  # liveness: a peer (or the store) stopped beating
    if cause in (Cause.HANG, "CollectiveTimeoutError"):
        return Outcome.HANG  # this rank, or a peer it waited on, made no progress within its budget
    if cause in (Cause.ORPHANED, "RuntimeError", "DistBackendError"):
        return Outcome.KILL  # a peer or our agent vanished under us
    return Outcome.STOPPED


def summary(timeline: Timeline) -> str:
    lines = []
    for a in timeline.attempts:
        steps = [str(c["step"]) for c in a.checkpoints]
        if len(steps) > 6:
            steps = [f"{len(steps)}: {steps[0]}", steps[1], "...", steps[-1]]
        ckpts = ", ".join(steps) or "none"
        extras = ""
        if a.overflow_skips:
            extras += f", fp16 overflow skips {a.overflow_skips}"
        if a.evals:
            step, metrics = a.evals[-1]
            extras += f", eval at {step}: " + " ".join(f"{k} {v:.4g}" for k, v in metrics.items())
        named = [e for e in a.stragglers if e.get("slow")]
        if named:
            extras += ", stragglers " + ", ".join(
                f"rank {e.get('rank')} on {e.get('host')} ({e.get('ratio')}x at step "
                f"{e.get('step')})"
                for e in named
            )
        if a.skipped_steps:
            extras += f", {len(a.skipped_steps)} step(s) skipped (listed below)"
        for r in a.rollbacks:
            extras += (
                f", rolled back at step {r.get('at_step')} ({r.get('reason')}) to step "
                f"{r.get('step')}, skipping {r.get('skipped')}"
            )
        stall = f"; stall {a.stall_s:.2f}s" if a.stall_s is not None else ""
        lines.append(
            f"attempt {a.index} ({a.began}{stall}) at +{a.start - timeline.t0:.1f}s: "
            f"world size {a.world_size}, "
            f"{f'steps {a.resumed_step}->{a.last_step}' if a.resumed else 'ended before resuming'}"
            f"{f' (from the {a.resumed_from})' if a.resumed_from else ''}"
            f", checkpoints {ckpts}{extras}; "
            f"ended: {a.outcome}{' (' + a.detail + ')' if a.detail else ''}"
        )
        lines += [
            f"  skipped step {e.get('step')} ({e.get('reason')}), "
            f"{len(e.get('samples', []))} samples: {e.get('samples', [])}"
            for e in a.skipped_steps
        ]
    return "\n".join(lines)


def _resumed_from(e: dict[str, Any]) -> str:
    if e.get("fresh") or "tier" not in e:
        return ""
    if e["tier"] == Tier.FAST:  # sharded: each node's copies, and its buddies'
        nodes = ", ".join(f"ranks {_span(r)} by rank {h}'s node" for h, r in e["served_by"].items())
        return (
            f"fast tier: {nodes}; {e.get('peer_bytes', 0)} bytes from other nodes, "
            f"{e.get('steps_saved', 0)} steps past the durable one"
        )
    if e["tier"] != Tier.LOCAL:
        return f"{e['tier']} tier"
    return f"local tier of rank {e.get('source_rank')}, {e.get('steps_saved', 0)} steps past the durable one"


def _span(ranks: list[int]) -> str:
    """Saved ranks as ``0-3`` when consecutive, else listed."""
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))

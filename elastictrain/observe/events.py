"""Rank 0's JSONL event log, every rank's sample ledger, and last words."""

from __future__ import annotations

import enum
import json
import logging
import os
import time
from typing import Any

logger = logging.getLogger(__name__)


class Name(str, enum.Enum):
    """A closed set of names written into the event log. Equal to its string, JSON-encoded as it,
    and printed as it, so readers compare against the member and never repeat the string."""

    __str__ = str.__str__
    __format__ = str.__format__


class Event(Name):
    """The ``event`` field of each line of the event log."""

    START = "start"  # an attempt began: world size, restart count, generation, host
    RESUME = "resume"  # state loaded (or ``fresh``): step, bytes, seconds
    MEMBERSHIP = "membership"  # resumed at another world size than the checkpoint's
    FIRST_STEP = (
        "first_step"  # the first step of an attempt completed: where the restart's time went
    )
    PROGRESS = "progress"  # periodic: step, loss and task metrics (means since the last one), steps/s, world size, grad norm, fp16 overflow skips
    EVAL = "eval"  # Task.evaluate's metrics at a step, averaged over ranks
    STRAGGLERS = "stragglers"  # periodic: per-rank step-time spread, each rank's score
    STRAGGLER = "straggler"  # a rank named persistently slow (slow) or recovered: host, ratio
    EVICTION = "eviction"  # a straggler's node evicted (evicted) or refused by a budget: evidence
    SELF_CHECK = "self_check"  # the nodes' self-check at a start: failed nodes, reasons, action
    SKIP = "skip"  # a step skipped on every rank, never applied: reason, samples, in a row
    ROLLBACK = "rollback"  # every rank back to an earlier copy, in place: why, window, retracted
    REPLICAS = "replicas_differ"  # twins' parameter digests differed: suspects, last agreed step
    CHECKPOINT = (
        "checkpoint"  # a checkpoint committed: step, reason, bytes, blocked/persist seconds
    )
    LOCAL_CHECKPOINT = "local_checkpoint"  # a node's local-tier copy committed (same fields)
    LOCAL_TIER = "local_tier"  # the local tier is off on a node, and why
    CORRUPT = "checkpoint_corrupt"  # resume skipped a committed checkpoint that did not verify
    CHECKPOINT_SKIPPED = "checkpoint_skipped"  # storage refused past the deadline, run went on
    CHECKPOINT_FAILED = "checkpoint_failed"  # a checkpoint the run needed could not be committed
    PREEMPTED = "preempted"  # a stop signal was honoured: signal, save seconds
    END = "end"  # training finished
    EXIT = "exit"  # any rank's last words before it ends early: cause, detail
    EPOCH_STATE = (
        "epoch_state"  # a membership epoch's transition: state, previous, reason, duration_s, step
    )


class Cause(Name):
    """Why a rank ended early, in its last words (``exit`` events). An exception's class name
    is used for causes outside this set."""

    HANG = "hang"
    PEER_SILENT = "peer_silent"  # a peer or the store stopped beating (liveness)
    ORPHANED = "orphaned"
    ABORTED = "aborted"  # a second interrupt (Ctrl-C) or stop signal: stopped at once


FLUSHES = frozenset(
    {
        Event.RESUME,
        Event.MEMBERSHIP,
        Event.CHECKPOINT,
        Event.CORRUPT,
        Event.CHECKPOINT_SKIPPED,
        Event.CHECKPOINT_FAILED,
        Event.ROLLBACK,
        Event.PREEMPTED,
        Event.END,
    }
)
"""Events after which the history mirror writes a segment: one per resume and commit, so the
mirror costs about one small object per checkpoint."""


class EventLog:
    """Appends one JSON object per line; opened in append mode so restarts extend the same story.

    Each write is a single ``write`` of one line on an O_APPEND file, flushed at once, so a kill
    can lose at most the line being written and never interleaves two lines. ``history``: rank 0's
    mirror of these lines into the checkpoint location (``observe.history``), kept with or without
    a local ``path``.
    """

    def __init__(self, path: str | None, *, enabled: bool, history: Any = None) -> None:
        self.path = path if enabled else None
        self.history = history if enabled else None
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._terminate_torn_line()

    def _terminate_torn_line(self) -> None:
        """A kill mid-write leaves a line without its newline; end it so the next one survives."""
        try:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        except OSError:  # missing or empty file
            return
        if torn:
            with open(self.path, "ab") as f:
                f.write(b"\n")

    def emit(self, event: str, **fields: Any) -> None:
        if not self.path and not self.history:
            return
        line = _line({"event": event, "time": time.time(), **fields})
        if self.history:
            self.history.add(line, flush=event in FLUSHES)
        if self.path:
            try:
                _append_line(self.path, line)
            except OSError as e:
                # An unwritable event log must not kill training; say so once per failure.
                logger.warning("could not append to event log %s: %s", self.path, e)


def _line(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True, default=str) + "\n"


def _append_line(path: str, line: str | dict[str, Any]) -> None:
    """One ``write`` of one line on an O_APPEND file: a kill loses at most that line."""
    line = line if isinstance(line, str) else _line(line)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class SampleLog:
    """Every rank's ledger of the dataset indices it trained on, one file per (generation, rank).

    Lines: ``step, micro, epoch, rank, world_size, generation, indices``, one per micro-batch
    (``--grad-accum-steps``). For each step the entries of the highest generation are the ones in
    the committed history. A step skipped on every rank (``train.numerics``) adds one line per
    rank after them: ``step, rank, world_size, generation, skipped`` (the reason): its samples
    were drawn, and not trained.
    """

    def __init__(
        self, directory: str | None, *, rank: int, world_size: int, generation: int
    ) -> None:
        self.path = None
        if directory:
            os.makedirs(directory, exist_ok=True)
            self.path = os.path.join(directory, f"samples-g{generation}-r{rank}.jsonl")
        self.rank, self.world_size, self.generation = rank, world_size, generation

    def record(self, step: int, micro: int, share: Any) -> None:
        if self.path:
            _append_line(
                self.path,
                {
                    "step": step,
                    "micro": micro,
                    "epoch": share.epoch,
                    "rank": self.rank,
                    "world_size": self.world_size,
                    "generation": self.generation,
                    "indices": share.indices.tolist(),
                },
            )

    def at(self, generation: int) -> SampleLog:
        """The same ledger from a new generation on (a rollback's: its steps are trained again)."""
        directory = os.path.dirname(self.path) if self.path else None
        return SampleLog(
            directory, rank=self.rank, world_size=self.world_size, generation=generation
        )

    def skip(self, step: int, reason: str) -> None:
        """``step``'s samples, recorded above, were not trained: a line of its own, after them."""
        if self.path:
            _append_line(
                self.path,
                {
                    "step": step,
                    "rank": self.rank,
                    "world_size": self.world_size,
                    "generation": self.generation,
                    "skipped": reason,
                },
            )


def read_sample_log(directory: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("samples-") and name.endswith(".jsonl"):
            out += read_events(os.path.join(directory, name))
    return out


def read_events(path: str) -> list[dict[str, Any]]:
    """Parse an event log, skipping a torn last line left by a kill."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


class LastWords:
    """Why this process is about to end early, as an ``exit`` event, from *any* rank.

    Only rank 0 writes the event log otherwise, but rank 0 may be the one that was stopped or
    killed, and then only a peer knows that the attempt died of a hang. Each rank appends to the
    ``--event-log`` path on its own host (on one node that is the same file; on others a file of
    last words only) and writes them beside the checkpoints (``history``), where the report finds
    every rank's. Opened lazily, so healthy ranks never touch either.
    """

    def __init__(self, path: str | None, rank: int, history: Any = None) -> None:
        self.path, self.rank, self.history = path, rank, history

    def keep_with(self, history: Any) -> None:
        """Also write them beside the checkpoints from now on. The recorder is made first, so
        the watchdog, the signal handlers and liveness get it when they are built; the history
        needs the attempt's generation, known only once the process group is up."""
        self.history = history

    def __call__(self, cause: str, detail: str) -> None:
        record = {"event": Event.EXIT, "time": time.time(), "cause": cause, "detail": detail}
        line = _line({**record, "rank": self.rank})
        if self.path:
            EventLog(self.path, enabled=True)  # ends a torn line first
            try:
                _append_line(self.path, line)
            except OSError as e:
                logger.warning("could not append to event log %s: %s", self.path, e)
        if self.history is not None:
            self.history.last_words(line)

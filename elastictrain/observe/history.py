"""The run's history kept with its checkpoints: rank 0's events and every rank's last words under
``<checkpoint-dir>/events/``, so one place holds the whole run, whichever hosts rank 0 ran on.

Rank 0 queues each event line. A background thread writes the queue as a new segment when a
resume, commit, stop or end asks for it, so a step never waits on storage. A failed write is
logged and retried at the next flush under the same name with the same lines plus newer ones, so a
retry neither loses nor duplicates a line. A dying rank writes its last words itself, bounded in
time. Nothing here ever raises into training: the history is a mirror, the run is what matters.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import storage

logger = logging.getLogger(__name__)

LAST_WORDS_WAIT_S = 5.0
"""How long a dying rank waits for its last words (and rank 0 for its queue) to reach storage."""


def segment_name(generation: int, seq: int) -> str:
    return f"g{generation}-s{seq:06d}.jsonl"


def last_words_name(generation: int, rank: int) -> str:
    return f"exit-g{generation}-r{rank:05d}-{time.time_ns()}.jsonl"


class RunHistory:
    """Rank 0 (``mirror=True``): the event log's mirror. Every rank: its last words."""

    def __init__(
        self, open_store: Callable[[], storage.CheckpointStore], *, rank: int, generation: int
    ) -> None:
        self._open_store, self._store = open_store, None
        self.rank, self.generation = rank, generation
        self._queue: list[str] = []  # lines not yet in a durable segment
        self._written = 0  # lines in durable segments
        self._seq = 0  # the next segment's number
        self._asked = self._tried = 0  # line counts: asked to be flushed / covered by an attempt
        self._cv = threading.Condition()
        self._write_lock = threading.Lock()
        self._failing = False
        self._thread: threading.Thread | None = None
        self._closing = False

    # -- rank 0: the mirror ----------------------------------------------------------------------
    def add(self, line: str, *, flush: bool) -> None:
        with self._cv:
            self._queue.append(line)
        if flush:
            self.flush()

    def flush(self, wait_s: float = 0.0) -> None:
        """Ask the writer thread for a segment of everything queued; ``wait_s``: wait up to that
        long for the attempt (at exit, so the last lines do not die with the process)."""
        with self._cv:
            self._asked = self._written + len(self._queue)
            if self._thread is None:
                self._closing = False
                self._thread = threading.Thread(
                    target=self._run, name="elastictrain-history", daemon=True
                )
                self._thread.start()
            self._cv.notify_all()
            if wait_s > 0:
                self._cv.wait_for(lambda: self._tried >= self._asked, timeout=wait_s)

    def close(self, wait_s: float = LAST_WORDS_WAIT_S) -> None:
        """Flush what is queued (waiting up to ``wait_s``) and end the writer thread: nothing this
        object started may still run when the interpreter tears down (a thread caught there can
        abort the process, and torchrun would count a clean finish as a failure)."""
        if self._thread is None:
            return
        self.flush(wait_s=wait_s)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(wait_s)
        self._thread = None

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._asked > self._tried or self._closing)
                if self._closing and self._asked <= self._tried:
                    return
                lines, seq, covered = list(self._queue), self._seq, self._written + len(self._queue)
            # On failure the lines stay queued; the retry rewrites this name with them and newer.
            ok = self._put(segment_name(self.generation, seq), "".join(lines).encode())
            with self._cv:
                if ok:
                    del self._queue[: len(lines)]
                    self._written += len(lines)
                    self._seq += 1
                self._tried = covered
                self._cv.notify_all()

    def _put(self, name: str, data: bytes) -> bool:
        try:
            with self._write_lock:
                if self._store is None:
                    self._store = self._open_store()
                self._store.write_history(name, data)
        except Exception as e:  # noqa: BLE001 - the mirror must never fail the run
            if not self._failing:
                logger.warning("run history: could not write %s (will retry): %s", name, e)
            self._failing = True
            return False
        if self._failing:
            logger.info("run history: writing again")
        self._failing = False
        return True

    # -- every rank: last words ------------------------------------------------------------------
    def last_words(self, line: str) -> None:
        """Written by the dying rank itself (bounded), and on rank 0 the queue with it."""
        done = threading.Event()

        def write() -> None:
            self._put(last_words_name(self.generation, self.rank), line.encode())
            done.set()

        threading.Thread(target=write, name="elastictrain-last-words", daemon=True).start()
        t0 = time.monotonic()
        done.wait(LAST_WORDS_WAIT_S)
        if self._thread is not None:
            self.flush(wait_s=max(0.0, LAST_WORDS_WAIT_S - (time.monotonic() - t0)))


def merge_lines(texts) -> list[dict[str, Any]]:
    """Events from several JSONL texts (hosts, the mirror), deduplicated and ordered by time; a
    torn or foreign line is skipped."""
    seen: set[str] = set()
    events = []
    for text in texts:
        for line in text.splitlines():
            line = line.strip()
            if not line or line in seen:
                continue
            seen.add(line)
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and "event" in record:
                events.append(record)
    events.sort(key=lambda e: float(e.get("time", 0.0)))
    return events
